"""#47: a float32 model's decode step in one parallel region with its work handed out by phase
(native team_f32.h, the plan's int8_fused = 3) gives the bits of the separate operators (1 and
0): the same token ids and logprobs over the decode steps of a batch of sequences of different
lengths (a padding mask), through the decode view (mode 0) and over the pool read in place
(mode 2), at 1, 2 and 3 threads, for a Llama and for a Qwen2 (a
qkv bias), both with 2 query heads a KV head. Where its conditions do not hold (head_dim 16:
no view attention kernel) the step runs the operators, and the team's step counter says which
ran; a W8A8 model is not taken by the float32 team either (its own team runs)."""

from __future__ import annotations

import pytest

from pdcore.config import ServerArgs
from pdcore.engine import native
from pdcore.runtime.llm_engine import LLMEngine
from pdcore.testing.tiny_models import make_tiny_model
from pdserve_testing import team_runs

NEW = 10  # tokens a sequence (the prompts: pdserve_testing.TEAM_PROMPTS)


@pytest.mark.parametrize("pool", ["view", "paged"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_f32_team_leaves_the_decode_steps_bits(arch, pool, tmp_path, monkeypatch):
    if native.op("team_steps") is None:
        pytest.skip("no native kernels here")
    if pool == "paged":  # no decode view: attention reads the pool in place (mode 2)
        monkeypatch.setenv("PDCORE_DECODE_KV_VIEW_MB", "0")
    # hidden 128, 4 heads: head_dim 32 (the view kernel's), 2 KV heads; inter 256
    path = make_tiny_model(str(tmp_path / arch), arch=arch, vocab_size=512, seed=3, hidden=128,
                           layers=3)
    eng = LLMEngine(ServerArgs(model_path=path, max_total_tokens=1024, page_size=4,
                               disable_radix_cache=True))
    try:
        if eng.engine.model.native is None:
            pytest.skip("no native decode loop here")
        assert (eng.engine.model.decode_kv.budget == 0) == (pool == "paged")
        for threads in (1, 2, 3):
            runs, team = team_runs(eng, [3, 1, 0, 3], NEW, threads)
            assert runs[0] == runs[1] == runs[2] == runs[3], threads
            assert all(len(ids) == NEW for ids, _ in runs[0])
            assert team[0] > 0 and team[3] > 0 and team[1] == team[2] == 0, (threads, team)
    finally:
        eng.close()


def test_where_the_f32_team_does_not_fit_the_operators_run(tmp_path):
    if native.op("team_steps") is None:
        pytest.skip("no native kernels here")
    # hidden 64, 4 heads: head_dim 16, no view attention kernel
    path = make_tiny_model(str(tmp_path / "m"), vocab_size=512, seed=3, hidden=64)
    eng = LLMEngine(ServerArgs(model_path=path, max_total_tokens=1024, page_size=4,
                               disable_radix_cache=True))
    try:
        if eng.engine.model.native is None:
            pytest.skip("no native decode loop here")
        runs, team = team_runs(eng, [3, 1], NEW, 2)
    finally:
        eng.close()
    assert runs[0] == runs[1]
    assert team == [0, 0]
