"""Tokens that reach the scheduler without a forward pass of its own (PD decode: the first token,
sampled by P and read from the aux row) go out at once, not one forward pass later.

The extension below stands in for PD decode: it holds admitted requests, and when told to,
hands them to the running batch with a first token (as DecodeExtension does on Success).
"""

from __future__ import annotations

import pytest

from pdcore.config import ServerArgs
from pdcore.messages.io import GenerateReq, SamplingParams
from pdcore.engine.sched.request import Phase, Req
from pdcore.engine.sched.scheduler import Extension, Scheduler
from pdcore.runtime.llm_engine import LLMEngine
from pdcore.testing.pages import pages_at_rest

FIRST = 42  # the token "P" sampled


class Handover(Extension):
    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.held: list[Req] = []
        self.ready: set[str] = set()

    def admit(self, req: Req) -> bool:
        req.phase = Phase.HELD
        self.held.append(req)
        return True

    def poll(self) -> None:
        blocks = self.sched.blocks
        for req in [r for r in self.held if r.rid in self.ready]:
            self.held.remove(req)
            req.pages = blocks.alloc(blocks.pages_for(len(req.prompt)))  # "KV written by P"
            req.num_computed = len(req.prompt)
            req.phase = Phase.RUNNING
            self.sched.running.append(req)
            self.sched.push_token(req, FIRST)

    def busy(self) -> bool:
        return bool(self.held)


@pytest.fixture
def engine(tiny_llama_dir):
    eng = LLMEngine(ServerArgs(model_path=str(tiny_llama_dir), max_total_tokens=512, page_size=4))
    forwards: list[list[str]] = []
    run = eng.loop.runner.run

    def counted(items):
        forwards.append([req.rid for req, _ in items])
        return run(items)

    eng.loop.runner.run = counted
    eng.scheduler.ext = Handover(eng.scheduler)
    try:
        yield eng, forwards
    finally:
        eng.close()


def request(rid: str, n: int = 3) -> GenerateReq:
    return GenerateReq(rid, [5, 6, 7, 8, 9], SamplingParams(max_new_tokens=n, temperature=0.0,
                                                            ignore_eos=True))


def tokens(outs) -> dict[str, list[int]]:
    return {m.rid: list(m.new_token_ids) for m in outs if m.new_token_ids}


def test_first_token_goes_out_before_the_next_forward_pass(engine) -> None:
    eng, forwards = engine
    ext: Handover = eng.scheduler.ext
    assert eng.lockstep.lead([request("a")]) == [] and forwards == []  # held, nothing to run
    ext.ready.add("a")
    assert tokens(eng.lockstep.lead([])) == {"a": [FIRST]}  # out at once ...
    assert forwards == []  # ... with no forward pass in between
    out = eng.lockstep.lead([])  # the forward pass runs on the very next step
    assert forwards == [["a"]] and len(tokens(out)["a"]) == 1
    out = eng.lockstep.lead([])
    assert forwards == [["a"], ["a"]] and out[-1].finished
    assert pages_at_rest(eng.scheduler)


def test_handovers_every_step_cannot_starve_the_running_batch(engine) -> None:
    eng, forwards = engine
    ext: Handover = eng.scheduler.ext
    rids = [f"r{i}" for i in range(4)]
    eng.lockstep.lead([request(r, n=8) for r in rids])
    steps_with_forward = []
    for i, rid in enumerate(rids):  # a new handover before every step
        ext.ready.add(rid)
        before = len(forwards)
        out = tokens(eng.lockstep.lead([]))
        steps_with_forward.append(len(forwards) > before)
        assert out.get(rid, [None])[0] == FIRST, f"step {i}: {rid}'s first token is late"
    # an early flush is never followed by another: the running batch moves every other step
    assert steps_with_forward == [False, True, False, True]
