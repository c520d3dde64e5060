"""#48: a W8A8 decode step's layer loop in one OpenMP parallel region (native team_step.h, the
plan's int8_fused = 2, the default) gives the bits of the loop that runs each operator on its
own (int8_fused = 1) and of the separate operators (0): the same token ids and logprobs over
the steps of a batch of sequences of different lengths, at each of their contexts. Where its
conditions do not hold (here head_dim 16: no view attention kernel) the step runs the
operators, and the team's step counter says which ran."""

from __future__ import annotations

import pytest

from pdcore.config import ServerArgs
from pdcore.engine import native
from pdcore.runtime.llm_engine import LLMEngine
from pdcore.testing.quant_models import make_w8a8_model
from pdserve_testing import build_tiny_llama, team_runs

NEW = 12  # tokens a sequence; the prompts: pdserve_testing.TEAM_PROMPTS
# head_dim 32 (the attention kernel's), 2 query heads a KV head, hidden and inter the
# norm's and silu_mul's multiples; head_dim 16: the team region does not apply
SHAPES = {"team": {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "num_hidden_layers": 3},
          "no_kernel": {}}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_the_team_region_leaves_the_decode_steps_bits(shape, tmp_path, monkeypatch):
    if native.op("team_steps") is None:
        pytest.skip("no native kernels here")
    monkeypatch.setenv("PDCORE_W8A8_LM_HEAD", "float")
    src = build_tiny_llama(tmp_path / "f", **SHAPES[shape])
    path = make_w8a8_model(str(src), str(tmp_path / "m"))
    eng = LLMEngine(ServerArgs(model_path=path, max_total_tokens=1024, page_size=4,
                               disable_radix_cache=True))
    try:
        model = eng.engine.model
        if model.native is None:
            pytest.skip("no native decode loop here")
        assert model.native["int8_fused"] == 2  # the default
        runs, team = team_runs(eng, [2, 1, 0, 2], NEW)
    finally:
        eng.close()
    assert runs[0] == runs[1] == runs[2] == runs[3]
    assert all(len(ids) == NEW for ids, _ in runs[0])
    if shape == "team":
        assert team[0] > 0 and team[3] > 0 and team[1] == team[2] == 0, team
    else:
        assert team == [0, 0, 0, 0]


def test_every_int8_path_serves_the_same_tokens(tmp_path, monkeypatch):
    """#48: the W8A8 model served on each int8 GEMM path this library and CPU run (1 AVX2, 2
    AVX-512 VNNI, 3 AMX-INT8: PDCORE_W8A8_GEMM caps the engine's choice) gives the same greedy
    token ids and logprobs, through the prefill (a 40-token prompt: AMX's 32-row tiles and a
    tail) and the decode steps, in the team region and operator by operator: every path's int32
    sums are exact and its epilogue the same."""
    o = native.ops()
    if o is None:
        pytest.skip("no native kernels here")
    paths = list(range(1, int(o.int8_best_path()) + 1))
    if len(paths) < 2:
        pytest.skip(f"one int8 path here ({paths}): nothing to compare")
    monkeypatch.setenv("PDCORE_W8A8_LM_HEAD", "float")
    src = build_tiny_llama(tmp_path / "f", **SHAPES["team"])
    model_path = make_w8a8_model(str(src), str(tmp_path / "m"))
    before = native.int8_path()
    runs = {}
    try:
        for p in paths:
            monkeypatch.setenv("PDCORE_W8A8_GEMM", {1: "avx2", 2: "vnni", 3: "amx"}[p])
            native._state.pop("int8", None)  # chosen again, for this engine
            eng = LLMEngine(ServerArgs(model_path=model_path, max_total_tokens=1024, page_size=4,
                                       disable_radix_cache=True))
            try:
                assert native.int8_path() == p and int(o.int8_set_path(0)) == p
                layer = eng.engine.model.layers[0]
                assert layer.mlp.down.int8.path == p
                runs[p], team = team_runs(eng, [2, 1], NEW)
                assert team[0] > 0, team
            finally:
                eng.close()
    finally:
        native._state["int8"] = before
        o.int8_set_path(before)
    for p in paths[1:]:
        assert runs[p] == runs[paths[0]], p
    assert runs[paths[0]][0] == runs[paths[0]][1]
