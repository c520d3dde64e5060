"""`--decode-step-prefill-tokens auto` (engine/sched/budget.py): the prefill budget of a step
that also runs decodes follows what the steps cost and what the decodes can still afford.

The scheduler runs here without a model: each step's time comes from a fake cost model
(decode rows and prefill tokens), booked through count_step as StepLoop.run books real ones,
and the scheduler's clock advances by it, so every budget is deterministic. One real server
on the tiny model checks the flag end to end (/metrics, the debug log)."""

from __future__ import annotations

import concurrent.futures as cf
import re
import time

import httpx
import pytest

from pdcore.config import ServerArgs
from pdcore.engine.kv.blocks import BlockManager
from pdcore.engine.sched.batch_run import StepResult
from pdcore.engine.sched.budget import FLOOR, PrefillBudget
from pdcore.engine.sched.request import Req
from pdcore.engine.sched.sampler import SampleState
from pdcore.engine.sched.scheduler import Scheduler, SchedulerConfig
from pdcore.errors import ConfigError
from pdcore.messages.io import SamplingParams
from pdcore.server.startup.args_parser import parse_server_args
from pdcore.testing.processes import ServerProcess

CHUNK = 2048


def _req(rid: str, prompt_len: int, new: int) -> Req:
    prompt = [3 + i % 97 for i in range(prompt_len)]
    sp = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)
    return Req(rid, prompt, SampleState.create(sp, prompt))


class Sim:
    """A scheduler whose steps take decode_s(rows) + token_s x prefill tokens seconds."""

    def __init__(self, budget: int | str, decode_s: float, token_s: float,
                 target_ms: float = 100.0, chunk: int = CHUNK, page: int = 16) -> None:
        auto = budget == "auto"
        self.s = Scheduler(BlockManager(4096, page), SchedulerConfig(
            max_running=64, chunk_size=chunk, max_prefill_tokens=8192, context_length=16384,
            decode_step_prefill=None if auto or budget == -1 else int(budget),
            decode_step_auto=auto, tpot_target_s=target_ms / 1e3))
        self.decode_s, self.token_s = decode_s, token_s
        self.clock = 1000.0
        self.mixed: list[int] = []  # prefill tokens of each step that also decoded

    def add(self, *reqs: Req) -> None:
        for r in reqs:
            self.s.add(r)

    def step(self) -> list[tuple[Req, int]]:
        s = self.s
        s.step_time = self.clock
        decodes = s.schedule_decodes()
        items = s.schedule_prefills([(r, 1) for r in decodes])
        prefill = sum(n for _, n in items[len(decodes):])
        took = (self.decode_s if decodes else 0.0) + self.token_s * prefill
        if decodes and prefill:
            self.mixed.append(prefill)
        s.count_step("extend" if prefill else "decode", took, items)
        self.clock += took
        for r, n in items:
            done = r.num_computed + n >= r.seq_len
            s.apply(StepResult(r, n, token=7 if done else None))
        s.collect()
        return items

    def run(self, steps: int) -> None:
        for _ in range(steps):
            if not self.step():
                return


def _busy(sim: Sim, decoding: int, new: int, waiting: int, prompt: int) -> None:
    """`decoding` requests decode (their prompts filled), then `waiting` long prompts queue."""
    sim.add(*(_req(f"d{i}", 8, new) for i in range(decoding)))
    sim.run(3)
    assert len(sim.s.running) == decoding and not sim.s.waiting
    sim.add(*(_req(f"w{i}", prompt, 4) for i in range(waiting)))


def test_cheap_steps_and_waiting_prompts_grow_the_budget() -> None:
    # a decode step of 20 ms, 0.1 ms a prefill token, decodes with 300 tokens to go: each can
    # afford a long step, so the queued prompts fill in whole chunks while they decode
    sim = Sim("auto", decode_s=0.020, token_s=0.0001)
    _busy(sim, decoding=8, new=300, waiting=4, prompt=3000)
    sim.run(12)
    assert sim.s.budget.decode_s == pytest.approx(0.020)
    assert sim.s.budget.token_s == pytest.approx(0.0001)
    assert max(sim.mixed) == CHUNK, sim.mixed
    # the fixed default under the same load carries 256 at most
    fixed = Sim(256, decode_s=0.020, token_s=0.0001)
    _busy(fixed, decoding=8, new=300, waiting=4, prompt=3000)
    fixed.run(12)
    assert max(fixed.mixed) == 256


def test_a_queue_that_never_empties_still_teaches_the_decode_cost() -> None:
    # closed-loop streams arriving together: no step ever decodes alone; the first (a prefill
    # alone) gives the token cost, the first mixed step the decodes' part
    sim = Sim("auto", decode_s=0.020, token_s=0.0001, chunk=512)
    sim.add(*(_req(f"s{i}", 100, 300) for i in range(4)), *(_req(f"w{i}", 3000, 4)
                                                            for i in range(6)))
    sim.run(30)
    assert sim.s.counters.decode_steps == 0
    assert sim.s.budget.decode_s == pytest.approx(0.020)
    assert sim.mixed[0] == FLOOR and max(sim.mixed) == 512, sim.mixed


def test_a_decode_step_near_the_target_keeps_the_floor() -> None:
    # 99 ms a decode step against a 100 ms target: no decode has time in hand, so mixed steps
    # carry the floor (256) and never more
    sim = Sim("auto", decode_s=0.099, token_s=0.0001)
    _busy(sim, decoding=8, new=300, waiting=4, prompt=3000)
    sim.run(20)
    assert sim.mixed and set(sim.mixed) == {FLOOR}, sim.mixed
    # the same decodes with a 1 s target have room again
    loose = Sim("auto", decode_s=0.099, token_s=0.0001, target_ms=1000)
    _busy(loose, decoding=8, new=300, waiting=4, prompt=3000)
    loose.run(20)
    assert max(loose.mixed) == CHUNK


def test_decodes_about_to_finish_bound_the_step() -> None:
    # decodes with 6 tokens left have little to spread a long step over: the budget is what
    # half of their slack buys, between the floor and the chunk
    sim = Sim("auto", decode_s=0.040, token_s=0.0002)
    _busy(sim, decoding=4, new=10, waiting=2, prompt=3000)
    sim.step()
    b = sim.s.budget
    assert FLOOR < b.last < CHUNK, b.last
    # at the mixed step: 3 tokens out (the prefill's, then two decode steps since the first
    # went out), 7 to go
    slack = 0.1 * (3 - 1 + 7) - 2 * 0.040 - 6 * 0.040
    assert b.last == pytest.approx((0.5 * slack - 0.040) / 0.0002, abs=16)
    assert b.last % 16 == 0  # whole pages


def test_a_number_pins_it_and_minus_one_is_the_chunk() -> None:
    for budget, cap in ((512, 512), (-1, CHUNK)):
        sim = Sim(budget, decode_s=0.020, token_s=0.0001)
        _busy(sim, decoding=8, new=300, waiting=4, prompt=3000)
        sim.run(12)
        assert sim.s.budget.estimates() is None and max(sim.mixed) == cap, (budget, sim.mixed)


def test_bounds_hold_whatever_the_timings() -> None:
    b = PrefillBudget(0.1, ceiling=100, page_size=16)
    assert b.floor == 100  # a chunk below 256 is the floor and the ceiling
    b = PrefillBudget(0.1, ceiling=4096, page_size=512)
    assert b.floor == 512  # never below one page
    r = _req("x", 4, 100)  # a decode: one token out, one position to compute
    r.output, r.num_computed, r.first_token_at = [1], 4, 0.0
    long = _req("p", 10_000, 4)
    b.observe("decode", 1e-6, [(r, 1)])
    b.observe("extend", 1e-6, [(r, 1), (long, 10_000)])  # absurdly cheap: the chunk, no more
    assert b.tokens([r], 0.0) == 4096
    for _ in range(30):
        b.observe("decode", 50.0, [(r, 1)])  # absurdly slow: the floor, not less
    assert b.tokens([r], 0.0) == 512
    with pytest.raises(ValueError):
        PrefillBudget(0.0, 100, 1)


def test_the_flags_parse_and_refuse_nonsense(capsys) -> None:
    for good, want in (("auto", "auto"), ("AUTO", "auto"), ("512", 512), (64, 64), ("-1", -1)):
        a = ServerArgs(decode_step_prefill_tokens=good)
        a.validate()
        assert a.decode_step_prefill_tokens == want
    for bad in ("0", "-2", "abc", "1.5", 0, True):
        with pytest.raises(ConfigError, match="decode-step-prefill-tokens"):
            ServerArgs(decode_step_prefill_tokens=bad).validate()
    for bad_ms in (0.0, -5.0, 1e9):
        with pytest.raises(ConfigError, match="decode-tpot-target-ms"):
            ServerArgs(decode_tpot_target_ms=bad_ms).validate()
    for argv, needle in ((["--decode-step-prefill-tokens", "lots"], "must be auto"),
                         (["--decode-tpot-target-ms", "0"], "--decode-tpot-target-ms 0"),
                         (["--decode-tpot-target-ms", "x"], "invalid float value")):
        with pytest.raises(SystemExit) as exc:
            parse_server_args(argv)
        assert exc.value.code == 2
        assert needle in capsys.readouterr().err


def test_tp_ranks_budget_alike(tmp_path) -> None:
    # TP 2 with auto: every rank schedules on rank 0's estimates (the step header), so the
    # ranks run the same steps and the greedy tokens equal TP 1's
    from pdcore.runtime.llm_engine import LLMEngine
    from pdcore.testing.pages import pages_at_rest
    from pdcore.testing.tiny_models import make_tiny_model

    path = make_tiny_model(str(tmp_path / "m"), arch="llama", heads=4, kv_heads=2, hidden=64,
                           seed=9)
    prompts = [[3 + (i * 37 + j * 11) % 500 for j in range(n)] for i, n in
               enumerate((5, 300, 23, 700))]
    sp = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    outs = []
    for tp in (1, 2):
        eng = LLMEngine(ServerArgs(model_path=path, max_total_tokens=4096, page_size=4,
                                   chunked_prefill_size=512, tp_size=tp,
                                   decode_step_prefill_tokens="auto"))
        try:
            outs.append([o["output_ids"] for o in eng.generate(prompts, sp)])
            assert eng.scheduler.budget is not None and eng.scheduler.budget.mixed_steps
            assert pages_at_rest(eng.scheduler)
        finally:
            eng.close()
    assert outs[0] == outs[1]


def test_a_real_server_reports_the_budget_it_gave(tiny_llama_dir) -> None:
    server = ServerProcess("--model-path", str(tiny_llama_dir), "--decode-step-prefill-tokens",
                           "auto", "--chunked-prefill-size", "512", "--page-size", "16",
                           "--log-level", "debug", "--skip-server-warmup")
    try:
        server.wait_healthy()
        with httpx.Client(base_url=server.url, timeout=120) as c:
            # one long decode first, then long prompts while it decodes: mixed steps
            def gen(n: int, new: int) -> dict:
                r = c.post("/generate", json={"input_ids": [5 + i % 300 for i in range(n)],
                                               "sampling_params": {"max_new_tokens": new,
                                                                   "ignore_eos": True,
                                                                   "temperature": 0}})
                assert r.status_code == 200, r.text
                return r.json()

            with cf.ThreadPoolExecutor(4) as pool:
                first = pool.submit(gen, 8, 120)
                time.sleep(1.0)
                rest = [pool.submit(gen, 1500, 4) for _ in range(3)]
                outs = [first.result(), *(f.result() for f in rest)]
            assert [len(o["output_ids"]) for o in outs] == [120, 4, 4, 4]
            text = c.get("/metrics").text
        steps = _metric(text, "pdserve_scheduler_prefill_budget_steps_total")
        given = _metric(text, "pdserve_scheduler_prefill_budget_tokens_total")
        last = _metric(text, "pdserve_scheduler_prefill_budget_tokens")
        assert steps >= 1 and 256 * steps <= given <= 512 * steps, (steps, given)
        assert 256 <= last <= 512
        assert _metric(text, "pdserve_scheduler_prefill_budget_decode_ms") > 0
    finally:
        server.stop()
    assert re.search(r"prefill budget \d+ tokens \(\d+ decodes", server.log()), \
        server.log()[-3000:]


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{name}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", text, re.MULTILINE)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))
