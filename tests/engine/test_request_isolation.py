"""One request's failure inside the scheduler fails that request alone: the others of its batch
and later requests are served, pages return to baseline (TP 1 and TP 2)."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from pdcore.config import ServerArgs
from pdcore.messages.io import GenerateReq, SamplingParams, TokenOut
from pdcore.runtime.llm_engine import LLMEngine
from pdcore.testing.pages import pages_at_rest
from pdcore.testing.tiny_models import make_tiny_model

VOCAB = 512
PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13], [21, 22, 23, 24, 25, 26, 27], [40, 41]]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("iso") / "m"), vocab_size=VOCAB, seed=3,
                           heads=4, kv_heads=2)


def _req(ids: list[int], top: int = 0, logprob: bool = False, new: int = 6) -> GenerateReq:
    return GenerateReq(uuid.uuid4().hex, list(ids), SamplingParams(max_new_tokens=new,
                                                                  temperature=0.0),
                       return_logprob=logprob, top_logprobs_num=top)


def _run(eng: LLMEngine, reqs: list[GenerateReq], max_iters: int = 500) -> dict[str, dict[str, Any]]:
    """Drive the lockstep until every request finished; results by rid."""
    acc: dict[str, dict[str, Any]] = {r.rid: {"ids": [], "error": None} for r in reqs}
    pending, msgs = {r.rid for r in reqs}, list(reqs)
    for _ in range(max_iters):
        out: TokenOut
        for out in eng.lockstep.lead(msgs):
            acc[out.rid]["ids"].extend(out.new_token_ids)
            if out.finished:
                acc[out.rid].update(error=out.error, status=out.error_status)
                pending.discard(out.rid)
        msgs = []
        if not pending:
            return acc
    raise AssertionError(f"requests never finished: {pending}")


def _check_isolation(eng: LLMEngine) -> None:
    good = [_req(p) for p in PROMPTS[:3]]
    bad = _req(PROMPTS[3], top=VOCAB * 100, logprob=True)
    reference = _run(eng, [_req(p) for p in PROMPTS[:3]])
    res = _run(eng, [good[0], bad, good[1], good[2]])  # one batch: all four prefill together
    assert res[bad.rid]["error"] and "top_logprobs_num" in res[bad.rid]["error"]
    assert res[bad.rid]["status"] == 400
    for g, ref in zip(good, reference.values()):
        assert res[g.rid]["error"] is None
        assert res[g.rid]["ids"] == ref["ids"] and len(ref["ids"]) == 6
    assert pages_at_rest(eng.scheduler)
    assert not eng.scheduler.reqs and not eng.scheduler.running
    later = _run(eng, [_req(PROMPTS[3], top=5, logprob=True)])  # the engine still serves
    assert next(iter(later.values()))["error"] is None


def test_bad_request_fails_alone_tp1(model_path: str) -> None:
    eng = LLMEngine(ServerArgs(model_path=model_path, max_total_tokens=1024, page_size=4))
    try:
        _check_isolation(eng)
    finally:
        eng.close()


def test_out_of_range_seed_is_a_400_that_fails_alone(model_path: str) -> None:
    """A seed torch cannot take is the client's error (400, naming the field), not a 500 that a
    router would retry and count against the server."""
    eng = LLMEngine(ServerArgs(model_path=model_path, max_total_tokens=1024, page_size=4))
    try:
        bad = GenerateReq(uuid.uuid4().hex, PROMPTS[0], SamplingParams(
            max_new_tokens=2, temperature=1.0, seed=1 << 64))
        good = _req(PROMPTS[1])
        res = _run(eng, [bad, good])
        assert res[bad.rid]["status"] == 400 and "seed" in res[bad.rid]["error"]
        assert res[good.rid]["error"] is None and len(res[good.rid]["ids"]) == 6
        assert pages_at_rest(eng.scheduler)
    finally:
        eng.close()


def test_failed_forward_fails_its_batch_only(model_path: str) -> None:
    eng = LLMEngine(ServerArgs(model_path=model_path, max_total_tokens=1024, page_size=4))
    try:
        runner = eng.loop.runner
        real = runner.model
        calls = {"n": 0}

        def broken(batch: Any, layers: Any, logits: bool = True) -> Any:
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("injected forward failure")
            return real(batch, layers, logits=logits)

        runner.model = broken
        res = _run(eng, [_req(p) for p in PROMPTS])
        assert all("injected forward failure" in r["error"] for r in res.values())
        assert all(r["status"] == 500 for r in res.values())
        assert pages_at_rest(eng.scheduler)
        again = _run(eng, [_req(p) for p in PROMPTS])
        assert all(r["error"] is None and len(r["ids"]) == 6 for r in again.values())
        assert pages_at_rest(eng.scheduler)
    finally:
        eng.loop.runner.model = real
        eng.close()


@pytest.mark.timeout(300)
def test_bad_request_fails_alone_tp2(model_path: str) -> None:
    """Rank 0 samples; its per-request error still reaches the broadcast, so rank 1 applies
    the same failure instead of waiting out the collective timeout."""
    eng = LLMEngine(ServerArgs(model_path=model_path, max_total_tokens=1024, page_size=4,
                               tp_size=2))
    try:
        _check_isolation(eng)
        assert all(p.is_alive() for p in eng.ranks.children)  # no rank died
    finally:
        eng.close()
