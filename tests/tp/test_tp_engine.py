"""Unified engine with tensor parallelism: TP=2 (and TP=4) greedy output equals TP=1 and
transformers, with even, uneven (3 KV heads on 2 ranks) and replicated (TP > KV heads) heads."""

from __future__ import annotations

import pytest
import torch

from pdcore.config import ServerArgs
from pdcore.messages.io import SamplingParams
from pdcore.engine.model.layers import kv_head_span, q_head_span, span
from pdcore.errors import ConfigError
from pdcore.runtime.llm_engine import LLMEngine
from pdcore.testing.greedy import check_greedy, hf_greedy
from pdcore.testing.pages import pages_at_rest
from pdcore.testing.tiny_models import make_tiny_model

SP = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)


def test_head_spans_cover_every_head_once():
    for total in (1, 2, 3, 8, 9):
        for size in range(1, 6):
            assert sum(span(total, r, size)[1] for r in range(size)) == total
    assert [kv_head_span(3, r, 2) for r in range(2)] == [(0, 1), (1, 2)]
    assert [q_head_span(9, 3, r, 2) for r in range(2)] == [(0, 3), (3, 6)]  # SmolLM2 on TP 2
    # TP > KV heads: each rank holds one replicated KV head and a share of its query group
    assert [kv_head_span(2, r, 4) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert [q_head_span(4, 2, r, 4) for r in range(4)] == [(0, 1), (1, 1), (2, 1), (3, 1)]
    with pytest.raises(ConfigError, match="too large"):
        q_head_span(4, 2, 0, 8)


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(2)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 47, 150, 23)]


def _run(path: str, tp: int, prompts: list[list[int]]) -> list[dict]:
    eng = LLMEngine(ServerArgs(model_path=path, max_total_tokens=2048, page_size=4,
                               chunked_prefill_size=64, tp_size=tp))
    try:
        outs = eng.generate(prompts, SP, return_logprob=True)
        assert pages_at_rest(eng.scheduler)
    finally:
        eng.close()
    assert all(not p.is_alive() for p in eng.ranks.children), "a TP rank outlived close()"
    return outs


@pytest.mark.parametrize("arch,heads,kv,tp", [
    ("llama", 4, 2, 2),  # even split
    ("qwen2", 6, 3, 2),  # uneven: 1 + 2 KV heads, q/k/v biases
    ("llama", 4, 1, 2),  # MQA: the one KV head replicated on both ranks
    ("qwen3", 4, 2, 4),  # TP 4 > 2 KV heads (replication), q/k norms
])
def test_tp_matches_tp1_and_transformers(tmp_path, arch, heads, kv, tp):
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(str(tmp_path / "m"), arch=arch, heads=heads, kv_heads=kv,
                           hidden=16 * heads, seed=9)
    prompts = _prompts(512)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    refs = [hf_greedy(hf, p, SP.max_new_tokens) for p in prompts]
    one = _run(path, 1, prompts)
    many = _run(path, tp, prompts)
    for o1, on, ref in zip(one, many, refs):
        assert on["output_ids"] == o1["output_ids"]
        check_greedy(on["output_ids"], ref, [lp[0] for lp in on["output_logprobs"]])


@pytest.mark.slow
def test_smollm2_tp2_matches_transformers(smollm2_greedy_refs):
    """The engine issue's prompt set on SmolLM2-135M (9 heads / 3 KV heads: uneven on 2);
    transformers' references shared with test_greedy_equivalence (tests/conftest.py)."""
    prompts, refs, new = smollm2_greedy_refs
    sp = SamplingParams(max_new_tokens=new, temperature=0.0)
    eng = LLMEngine(ServerArgs(max_total_tokens=8192, page_size=16, chunked_prefill_size=256,
                               tp_size=2))
    try:
        outs = eng.generate(prompts, sp, return_logprob=True)
    finally:
        eng.close()
    verdicts = [check_greedy(o["output_ids"], r, [lp[0] for lp in o["output_logprobs"]])
                for o, r in zip(outs, refs)]
    assert verdicts.count("identical") >= 7, verdicts


@pytest.mark.parametrize("argv,needle", [
    (["--tp-size", "2", "--nnodes", "2"], "--nnodes > 1 needs --dist-init-addr"),
    (["--tp-size", "3", "--nnodes", "2", "--dist-init-addr", "127.0.0.1:1234"],
     "must be a multiple of --nnodes"),
    (["--tp-size", "2", "--dist-init-addr", "nonsense"], "HOST:PORT"),
])
def test_bad_parallel_flags_exit_2(argv, needle, capsys):
    from pdcore.server.startup.args_parser import parse_server_args

    with pytest.raises(SystemExit) as e:
        parse_server_args(argv)
    assert e.value.code == 2
    assert needle in capsys.readouterr().err


def test_one_host_ranks_meet_at_a_fresh_file_store_not_a_port(tmp_path, monkeypatch):
    """The ranks of one host met at a loopback port picked free and bound later by rank 0: in
    between, any other process could take it (CI saw a TP-2 server die of EADDRINUSE). They now
    meet at a file store under a new name each time, which a closed group leaves behind no more."""
    import tempfile

    from pdcore.runtime.ranks import RankGroup
    from pdcore.runtime.topology import init_method

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    args = ServerArgs(model_path="m", tp_size=2)
    a, b = init_method(args), init_method(args)
    assert a != b and a.startswith(f"file://{tmp_path}/") and b.startswith(f"file://{tmp_path}/")
    assert init_method(ServerArgs(model_path="m", tp_size=2, nnodes=2, dist_init_addr="h:7")
                       ) == "tcp://h:7"  # several hosts: the address the user named
    left = tmp_path / a.removeprefix(f"file://{tmp_path}/")
    left.write_text("a rank died before leaving")
    group = RankGroup(args)
    group.method = a
    group.close()
    assert not left.exists()
