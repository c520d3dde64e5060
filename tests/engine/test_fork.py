"""Parallel samples on a decode server fork from sample 0's received prompt pages.

The real DecodeExtension runs on an in-process engine (tiny Llama); a stand-in KV manager plays
P: when told to, it fills the destination pages with the prompt's K/V (a forward pass into
them), writes the aux row with the first token, and reports Success, as the wire would.
"""

from __future__ import annotations

from concurrent.futures import Future

import pytest
import torch

from pdcore.config import ServerArgs
from pdcore.disagg.aux import AuxBuffers, AuxRow
from pdcore.disagg.decode.sched import DecodeExtension
from pdcore.disagg.states import KVPoll
from pdcore.errors import InvalidRequestError
from pdcore.messages.io import AbortReq, GenerateReq, GrammarSpec, PDRoute, SamplingParams
from pdcore.runtime.grammar_gate import GrammarGate
from pdcore.engine.kv.blocks import BlockManager
from pdcore.engine.sched.fork import fork, shared_pages
from pdcore.engine.sched.request import Phase, Req
from pdcore.engine.sched.sampler import SampleState
from pdcore.runtime.llm_engine import LLMEngine
from pdcore.testing.pages import pages_at_rest

PROMPT_7 = [11, 12, 13, 14, 15, 16, 17]  # the last position shares a page with others (page 4)
PROMPT_8 = [21, 22, 23, 24, 25, 26, 27, 28]  # the last position ends a page (page 4)
NEW = 6


class StandInP:
    """The decode KV manager's interface, with P played in-process."""

    def __init__(self) -> None:
        self.state: dict[int, KVPoll] = {}
        self.dest: dict[int, tuple[list[int], int]] = {}
        self.reasons: dict[int, str] = {}
        self.hold = False  # keep rooms in Bootstrapping (P not found yet)

    def add(self, room: int, host: str, port: int, prefill_dp_rank: int | None = None) -> None:
        self.state[room] = KVPoll.Bootstrapping if self.hold else KVPoll.WaitingForInput

    def poll(self, room: int) -> KVPoll:
        return self.state.get(room, KVPoll.Failed)

    def send_transfer_info(self, room: int, pages, slot: int, prefix_pages: int = 0,
                           prefix_digest: str = "", prompt_digest: str = "") -> None:
        self.state[room] = KVPoll.Transferring
        self.dest[room] = ([int(p) for p in pages], slot)

    def abort(self, room: int, reason: str) -> None:
        self.state[room], self.reasons[room] = KVPoll.Failed, reason

    def failure_reason(self, room: int) -> str:
        return self.reasons.get(room, "")

    def peer_fault(self, room: int) -> bool:
        return False  # a failure of the stand-in's own making, not its peer's

    def release(self, room: int) -> None:
        pass

    def metrics(self) -> dict:
        return {}

    def close(self) -> None:
        pass


@pytest.fixture(params=[1, 4], ids=["page1", "page4"])
def dec(request, tiny_llama_dir):
    args = ServerArgs(model_path=str(tiny_llama_dir), max_total_tokens=256,
                      page_size=request.param, disaggregation_mode="decode")
    # a decode server has no prefix cache unless asked (its pages come from prefill)
    eng = LLMEngine(ServerArgs(model_path=str(tiny_llama_dir), max_total_tokens=256,
                               page_size=request.param, disable_radix_cache=True))
    sched = eng.scheduler
    aux = AuxBuffers(eng.engine.kv.pool, 8)
    mgr = StandInP()
    sched.ext = DecodeExtension(sched, mgr, aux, args)
    try:
        yield eng, mgr, aux
    finally:
        eng.close()


@pytest.fixture(scope="module")
def unified(tiny_llama_dir):
    eng = LLMEngine(ServerArgs(model_path=str(tiny_llama_dir), max_total_tokens=256,
                               page_size=4))
    cache: dict[tuple, list[int]] = {}

    def run(prompt: list[int], seed: int | None = None) -> list[int]:
        key = (tuple(prompt), seed)
        if key not in cache:
            sp = greedy() if seed is None else seeded(seed)
            cache[key] = eng.generate([prompt], sp)[0]["output_ids"]
        return cache[key]

    yield run
    eng.close()


def greedy() -> SamplingParams:
    return SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)


def seeded(seed: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=NEW, temperature=1.0, seed=seed, ignore_eos=True)


def group(prompt: list[int], n: int, room: int = 7, seed: int | None = None
          ) -> list[GenerateReq]:
    """What the HTTP layer of a decode server sends for one prompt with n samples."""
    out = []
    for j in range(n):
        sp = greedy() if seed is None else seeded(seed + j)
        route = PDRoute("127.0.0.1", 1, room, fork_of=f"s{room}-0" if j else None)
        out.append(GenerateReq(f"s{room}-{j}", list(prompt), sp, route=route))
    return out


def one_message(prompt: list[int], n: int, room: int = 7) -> GenerateReq:
    """What the HTTP layer of a decode server sends for one prompt with n samples since s9:
    sample 0 carrying the others (GenerateReq.forks), so none can arrive after its KV."""
    lead, *rest = group(prompt, n, room)
    lead.forks = rest
    return lead


def deliver(eng: LLMEngine, mgr: StandInP, aux: AuxBuffers, room: int, prompt: list[int],
            seed: int | None = None) -> None:
    """P's part: the prompt's K/V into D's pages, the first token into the aux row."""
    pages, slot = mgr.dest[room]
    sp = greedy() if seed is None else seeded(seed)
    p_req = Req("p", list(prompt), SampleState.create(sp, prompt), pages=list(pages))
    res = eng.loop.runner.run([(p_req, len(prompt))])[0]
    aux.write(slot, AuxRow(room=room, first_token_id=res.token, prompt_tokens=len(prompt)))
    mgr.state[room] = KVPoll.Success


def step(eng: LLMEngine, outs: dict, msgs: list | None = None) -> dict:
    """One scheduler iteration; its outputs are added to `outs` (per rid)."""
    for m in eng.lockstep.lead(msgs or []):
        o = outs.setdefault(m.rid, {"ids": [], "error": None, "done": False})
        o["ids"] += m.new_token_ids
        o["error"] = o["error"] or m.error
        o["done"] = o["done"] or m.finished
    return outs


def drain(eng: LLMEngine, outs: dict, msgs: list | None = None, limit: int = 100) -> dict:
    """Step until every request the scheduler knows has finished; outputs per rid."""
    for _ in range(limit):
        step(eng, outs, msgs)
        msgs = None
        if not eng.scheduler.reqs:
            return outs
    raise AssertionError(f"not finished: {list(eng.scheduler.reqs)}")


def page_bytes(eng: LLMEngine, page: int) -> list[torch.Tensor]:
    return [t[page].clone() for k, v in eng.engine.kv.layers for t in (k, v)]


@pytest.mark.parametrize("prompt", [PROMPT_7, PROMPT_8], ids=["mid-page", "page-end"])
def test_followers_share_pages_copy_the_last_and_match_unified(dec, unified, prompt):
    eng, mgr, aux = dec
    blocks = eng.scheduler.blocks
    outs: dict = {}
    eng.lockstep.lead(group(prompt, 3))
    assert [r.phase for r in eng.scheduler.reqs.values()] == [Phase.HELD] * 3
    assert len(mgr.dest) == 1  # one room, one transfer for three samples
    deliver(eng, mgr, aux, 7, prompt)
    step(eng, outs)  # Success: fork, then sample 0's first token goes out
    lead, f1, f2 = (eng.scheduler.reqs[f"s7-{j}"] for j in range(3))
    s = shared_pages(blocks, len(prompt))
    assert f1.pages[:s] == f2.pages[:s] == lead.pages[:s]
    assert all(blocks.refcount(p) == 3 for p in lead.pages[:s])
    last = lead.pages[s]
    assert blocks.refcount(last) == 1
    for f in (f1, f2):
        own = f.pages[s]
        assert own != last and blocks.refcount(own) == 1 and len(f.pages) == s + 1
        assert all(torch.equal(a, b) for a, b in zip(page_bytes(eng, own),
                                                     page_bytes(eng, last)))
        assert f.num_computed == len(prompt) - 1 and f.output == []
    assert lead.output and lead.num_computed == len(prompt)
    # poison each follower's copy of the last prompt position: the next forward must rewrite
    # it there (its own page), and leave the leader's page as it was
    off = (len(prompt) - 1) % blocks.page_size
    for f in (f1, f2):
        for k, v in eng.engine.kv.layers:
            k[f.pages[s], off] = float("nan")
            v[f.pages[s], off] = float("nan")
    last_before = page_bytes(eng, last)
    step(eng, outs)
    for f in (f1, f2):
        assert len(f.output) == 1
        assert all(torch.isfinite(t[off]).all() for t in page_bytes(eng, f.pages[s]))
    assert all(torch.equal(a[: off + 1], b[: off + 1])
               for a, b in zip(page_bytes(eng, last), last_before))
    drain(eng, outs)
    want = unified(prompt)
    assert [outs[f"s7-{j}"]["ids"] for j in range(3)] == [want] * 3
    assert all(outs[f"s7-{j}"]["error"] is None for j in range(3))
    assert pages_at_rest(eng.scheduler)
    stats = eng.loop.stats()
    assert stats["disagg_transfers_total"] == 1 and stats["disagg_samples_total"] == 3
    assert stats["disagg_forks_total"] == 2 and stats["disagg_transfers_per_request"] == 1


def test_seeded_followers_sample_like_unified(dec, unified):
    eng, mgr, aux = dec
    eng.lockstep.lead(group(PROMPT_7, 3, seed=100))
    deliver(eng, mgr, aux, 7, PROMPT_7, seed=100)
    outs = drain(eng, {})
    # sample j carries seed 100 + j; a follower samples its first token from the prompt's
    # last logits with its own generator, exactly as a unified request with that seed does
    for j in (1, 2):
        assert outs[f"s7-{j}"]["ids"] == unified(PROMPT_7, 100 + j)
    assert len({tuple(o["ids"]) for o in outs.values()}) == 3
    assert pages_at_rest(eng.scheduler)


@pytest.mark.parametrize("when", ["bootstrapping", "transferring"])
def test_leader_aborted_before_its_kv_fails_the_followers(dec, when):
    eng, mgr, _ = dec
    blocks = eng.scheduler.blocks
    mgr.hold = when == "bootstrapping"
    eng.lockstep.lead(group(PROMPT_7, 3))
    assert (7 in mgr.dest) == (when == "transferring")
    outs = drain(eng, {}, [AbortReq("s7-0", "client went away")])
    assert outs["s7-0"]["done"]
    for j in (1, 2):
        assert outs[f"s7-{j}"]["done"] and "s7-0" in outs[f"s7-{j}"]["error"], outs
    ext: DecodeExtension = eng.scheduler.ext
    if when == "transferring":  # P may still write into the leader's pages: held a while
        assert ext.stats()["disagg_quarantined_pages"] == blocks.pages_for(len(PROMPT_7))
        ext.quarantine = [(0.0, pages) for _, pages in ext.quarantine]
        eng.lockstep.lead([])
    assert pages_at_rest(eng.scheduler)


def test_transfer_failure_fails_every_sample_with_the_reason(dec):
    eng, mgr, _ = dec
    eng.lockstep.lead(group(PROMPT_8, 2))
    mgr.abort(7, "prefill server lost")
    outs = drain(eng, {})
    assert all("prefill server lost" in outs[f"s7-{j}"]["error"] for j in range(2)), outs
    assert pages_at_rest(eng.scheduler)


def test_aborting_one_sample_frees_only_its_own_references(dec, unified):
    eng, mgr, aux = dec
    blocks = eng.scheduler.blocks
    outs = step(eng, {}, group(PROMPT_7, 4))
    step(eng, outs, [AbortReq("s7-3")])  # parked: it holds nothing yet
    deliver(eng, mgr, aux, 7, PROMPT_7)
    step(eng, outs)
    lead = eng.scheduler.reqs["s7-0"]
    s = shared_pages(blocks, len(PROMPT_7))
    shared = lead.pages[:s]
    assert all(blocks.refcount(p) == 3 for p in shared)
    own = eng.scheduler.reqs["s7-1"].pages[s]
    step(eng, outs, [AbortReq("s7-1"), AbortReq("s7-0")])  # a stop string hit, say
    assert all(blocks.refcount(p) == 1 for p in shared)  # sample 2 still reads them
    assert blocks.refcount(own) == 0
    drain(eng, outs)
    assert outs["s7-3"]["done"] and outs["s7-1"]["done"]
    assert outs["s7-2"]["ids"] == unified(PROMPT_7)
    assert pages_at_rest(eng.scheduler)


def test_a_follower_without_its_leader_fails_clearly(dec):
    eng, _, _ = dec
    stray = group(PROMPT_7, 2, room=9)[1]
    outs = drain(eng, {}, [stray])
    assert "forks from sample 's9-0'" in outs["s9-1"]["error"]
    assert pages_at_rest(eng.scheduler)


def test_no_free_page_for_the_copy_recomputes_the_tail(dec, unified):
    eng, mgr, aux = dec
    blocks = eng.scheduler.blocks
    outs = step(eng, {}, group(PROMPT_7, 2))
    deliver(eng, mgr, aux, 7, PROMPT_7)
    hog = blocks.alloc(blocks.num_free)  # every page taken when the KV arrives
    step(eng, outs)
    f = eng.scheduler.reqs["s7-1"]
    assert f.phase is Phase.WAITING and f.num_computed % blocks.page_size == 0
    assert eng.loop.stats()["disagg_fork_recomputes_total"] == 1
    blocks.free(hog)
    drain(eng, outs)
    assert outs["s7-1"]["ids"] == outs["s7-0"]["ids"] == unified(PROMPT_7)
    assert pages_at_rest(eng.scheduler)


def test_fork_unit_refcounts():
    blocks = BlockManager(8, 4)
    layers = [(torch.randn(8, 4, 1, 2), torch.randn(8, 4, 1, 2))]
    st = SampleState.create(greedy(), [1])
    lead = Req("a", list(range(10)), st, pages=blocks.alloc(3))  # positions 0..9: 3 pages
    f = Req("b", list(range(10)), st)
    assert fork(blocks, layers, lead, f)
    assert f.pages[:2] == lead.pages[:2] and f.num_computed == 9
    assert [blocks.refcount(p) for p in lead.pages] == [2, 2, 1]
    assert torch.equal(layers[0][0][f.pages[2]], layers[0][0][lead.pages[2]])
    with pytest.raises(ValueError):
        fork(blocks, layers, lead, f)  # already holds pages
    blocks.free(f.pages)
    blocks.free(lead.pages)
    assert blocks.num_free == 8


def test_a_leader_finished_by_its_first_token_leaves_the_pages_to_its_samples(dec, unified):
    eng, mgr, aux = dec
    reqs = group(PROMPT_7, 3)
    for r in reqs:
        r.sampling.max_new_tokens = 1  # P's token ends sample 0 the moment it arrives
    outs = step(eng, {}, reqs)
    deliver(eng, mgr, aux, 7, PROMPT_7)
    drain(eng, outs)
    assert [outs[f"s7-{j}"]["ids"] for j in range(3)] == [unified(PROMPT_7)[:1]] * 3
    assert pages_at_rest(eng.scheduler)


def test_a_cached_prefix_without_an_aux_row_is_given_back_until_one_is_free(tiny_llama_dir):
    """D with a prefix cache: the prompt's cached prefix is locked before the aux row is asked
    for; with none free the request waits holding no page (SchedulerAPI.drop_pages: the prefix
    is unlocked, evictable again), and takes it once a row is free (extend_pages: the rest of
    the prompt). Aborted while P may write, its prefix goes back at once and the rest is held
    (take_pages, quarantine) until it expires; then the pool is at rest."""
    args = ServerArgs(model_path=str(tiny_llama_dir), max_total_tokens=256, page_size=4,
                      disaggregation_mode="decode")
    eng = LLMEngine(ServerArgs(model_path=str(tiny_llama_dir), max_total_tokens=256,
                               page_size=4))
    try:
        sched, prompt = eng.scheduler, PROMPT_8 + [31]
        eng.generate([PROMPT_8 + [41, 42, 43]], greedy())  # caches PROMPT_8's two pages
        cache = sched.cache
        assert cache.num_pages >= 2 and cache.evictable() == cache.num_pages
        aux, mgr = AuxBuffers(eng.engine.kv.pool, 2), StandInP()
        ext = DecodeExtension(sched, mgr, aux, args)
        sched.ext = ext
        taken = [aux.alloc(), aux.alloc()]  # no aux row free
        eng.lockstep.lead([GenerateReq("d-1", prompt, greedy(),
                                       route=PDRoute("127.0.0.1", 1, 5))])
        req = sched.reqs["d-1"]
        assert req.phase is Phase.HELD and req.pages == [] and 5 not in mgr.dest
        assert cache.evictable() == cache.num_pages  # the prefix it matched is unlocked
        aux.free(taken.pop())
        eng.lockstep.lead([])
        pages, _ = mgr.dest[5]
        assert req.disagg.prefix_pages == 2 and pages[:2] == req.pages[:2]
        assert len(req.pages) == sched.blocks.pages_for(len(prompt))
        eng.lockstep.lead([AbortReq("d-1", "client went away")])
        assert ext.stats()["disagg_quarantined_pages"] == len(pages) - 2
        assert not pages_at_rest(sched)
        ext.quarantine = [(0.0, p) for _, p in ext.quarantine]
        eng.lockstep.lead([])
        assert pages_at_rest(sched)
    finally:
        eng.close()


def test_samples_carried_in_sample_0s_message_are_parked_on_it(dec, unified):
    eng, mgr, aux = dec
    eng.lockstep.lead([one_message(PROMPT_7, 3)])
    assert [(r.rid, r.phase) for r in eng.scheduler.reqs.values()] == [
        (f"s7-{j}", Phase.HELD) for j in range(3)]
    assert len(mgr.dest) == 1
    deliver(eng, mgr, aux, 7, PROMPT_7)
    outs = drain(eng, {})
    assert [outs[f"s7-{j}"]["ids"] for j in range(3)] == [unified(PROMPT_7)] * 3
    assert eng.loop.stats()["disagg_forks_total"] == 2
    assert pages_at_rest(eng.scheduler)


class HeldGrammar:
    """A grammar backend whose one compile finishes when the test says."""

    def __init__(self) -> None:
        self.fut: Future = Future()

    def ready(self, spec) -> bool:
        return False

    def prepare(self, spec) -> Future:
        return self.fut


def test_the_grammar_gate_holds_and_answers_the_carried_samples_with_sample_0():
    """A constrained prompt's samples wait in the gate inside sample 0's message: admitted
    with it, refused with it, aborted with it; an abort of one carried sample ends it alone."""
    spec = GrammarSpec("regex", "a+")

    def msg(n: int) -> GenerateReq:
        lead = one_message(PROMPT_7, n)
        for r in (lead, *lead.forks):
            r.sampling.grammar = spec
        return lead

    backend = HeldGrammar()
    gate, lead = GrammarGate(backend, timeout_s=60), msg(3)
    assert gate.admit([lead]) == ([], [])
    _, ended = gate.admit([AbortReq("s7-1", "a stop string")])
    assert [o.rid for o in ended] == ["s7-1"] and [f.rid for f in lead.forks] == ["s7-2"]
    backend.fut.set_result(None)
    assert gate.admit([]) == ([lead], [])

    backend = HeldGrammar()
    gate = GrammarGate(backend, timeout_s=60)
    gate.admit([msg(3)])
    backend.fut.set_exception(InvalidRequestError("no such regex", "regex"))
    ready, ended = gate.admit([])
    assert not ready and sorted(o.rid for o in ended) == ["s7-0", "s7-1", "s7-2"]
    assert all(o.error_status == 400 and o.finished for o in ended)

    gate = GrammarGate(HeldGrammar(), timeout_s=60)
    gate.admit([msg(2)])
    _, ended = gate.admit([AbortReq("s7-0", "client went away")])
    assert sorted(o.rid for o in ended) == ["s7-0", "s7-1"] and not gate.pending
    assert all(o.finished and o.finish_reason["type"] == "abort" for o in ended)
