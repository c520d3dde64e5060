"""The prefix cache inside the engine: greedy output is token-identical with the cache on and off
and to transformers, the cached tokens each request reports are exactly what the tree could
give it, and the pool is at rest after every test (and empty after a flush)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from pdcore.config import ServerArgs
from pdcore.messages.io import AbortReq, GenerateReq, SamplingParams
from pdcore.runtime.llm_engine import LLMEngine
from pdcore.testing.greedy import check_greedy, hf_greedy
from pdcore.testing.pages import pages_at_rest
from pdcore.testing.tiny_models import make_tiny_model

VOCAB = 512
NEW = 12


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, Any]]:
    """arch -> (path, transformers model) of a tiny random model."""
    from transformers import AutoModelForCausalLM

    out = {}
    for arch in ("llama", "qwen2"):
        path = make_tiny_model(str(tmp_path_factory.mktemp("pc") / arch), arch=arch,
                               vocab_size=VOCAB, seed=11)
        out[arch] = (path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval())
    return out


def rand_ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g).tolist()  # no bos/eos ids


def greedy(new: int = NEW) -> SamplingParams:
    return SamplingParams(max_new_tokens=new, temperature=0.0)


@dataclass
class Out:
    ids: list[int] = field(default_factory=list)
    out_lps: list[Any] = field(default_factory=list)
    in_lps: list[Any] | None = None
    cached: int | None = None  # from the first TokenOut
    first_step: int = -1
    error: str | None = None
    done: bool = False


class Driver:
    """Drives an LLMEngine's lockstep one step at a time and gathers outputs by rid."""

    def __init__(self, eng: LLMEngine) -> None:
        self.eng, self.outs, self.steps, self.reported = eng, {}, 0, 0
        self.sent: set[str] = set()
        self.sched = eng.scheduler

    def req(self, ids: list[int], sp: SamplingParams | None = None, logprob_start: int = -1,
            logprob: bool = False, top: int = 0) -> GenerateReq:
        g = GenerateReq(uuid.uuid4().hex, list(ids), sp or greedy(), logprob, logprob_start, top)
        self.outs[g.rid] = Out()
        return g

    def step(self, msgs: list[Any] = ()) -> None:
        self.steps += 1
        self.sent.update(m.rid for m in msgs if isinstance(m, GenerateReq))
        for m in self.eng.lockstep.lead(list(msgs)):
            o = self.outs[m.rid]
            if o.first_step < 0:
                o.first_step, o.cached = self.steps, m.cached_tokens
                self.reported += m.cached_tokens
            o.ids.extend(m.new_token_ids)
            o.out_lps.extend(m.output_logprobs)
            if m.input_logprobs is not None:
                o.in_lps = m.input_logprobs
            if m.finished:
                o.done, o.error = True, m.error

    def run(self, reqs: list[GenerateReq], max_steps: int = 3000) -> list[Out]:
        """Submits those of `reqs` not sent yet, steps until all of them finished."""
        self.step([r for r in reqs if r.rid not in self.sent])
        for _ in range(max_steps):
            if all(self.outs[r.rid].done for r in reqs):
                break
            self.step()
        outs = [self.outs[r.rid] for r in reqs]
        assert all(o.done and o.error is None for o in outs), [
            o.error if o.done else f"not finished after {max_steps} steps" for o in outs]
        return outs

    def one(self, ids: list[int], **kw: Any) -> Out:
        return self.run([self.req(ids, **kw)])[0]


@contextmanager
def engine(path: str, **kw: Any) -> Iterator[Driver]:
    """An engine whose pool must be at rest at the end, then empty after a flush; the cached
    tokens its requests reported must be what its counters say."""
    args = {"max_total_tokens": 4096, "page_size": 4, **kw}
    eng = LLMEngine(ServerArgs(model_path=path, **args))
    try:
        d = Driver(eng)
        yield d
        s = eng.scheduler
        assert not s.reqs and pages_at_rest(s)
        stats = eng.loop.stats()
        assert stats["cache_hit_tokens_total"] == d.reported
        assert stats["radix_cache_enabled"] is (s.cache is not None)
        if s.cache is None:
            assert d.reported == 0 and stats["radix_cache_pages"] == 0
            assert s.flush_cache()["flushed"] is False
        else:
            assert s.flush_cache()["flushed"] is True
            assert stats["cache_hit_rate"] == pytest.approx(
                d.reported / stats["prompt_tokens_total"])
        assert s.blocks.num_free == s.blocks.num_pages
    finally:
        eng.close()


def cacheable(history: list[list[int]], prompt: list[int], limit: int, ps: int) -> int:
    """Tokens of `prompt[:limit]` a tree holding the full pages of `history` can give."""
    best = 0
    for h in history:
        n = 0
        while n < min(len(h), limit) and h[n] == prompt[n]:
            n += 1
        best = max(best, n // ps * ps)
    return best


def boundary_lengths(ps: int) -> list[int]:
    if ps == 1:
        return [0, 1, 2, 3, 5]
    return [ps - 1, ps, ps + 1, 2 * ps - 1, 2 * ps, 2 * ps + 1, 3 * ps]


# ---- token identity -----------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("ps", [1, 16])
def test_shared_prefixes_around_page_boundaries(models, arch: str, ps: int) -> None:
    path, hf = models[arch]
    base = rand_ids(3 * ps + 6, seed=ps)
    prompts = [base, base]  # a repeated prompt
    for i, n in enumerate(boundary_lengths(ps)):
        prompts.append(base[:n] + rand_ids(5, seed=100 + i))
    prompts += [prompts[3], base[:2 * ps]]  # a repeat, and a prompt that is a whole cached run
    with engine(path, page_size=ps) as on, engine(path, page_size=ps,
                                                   disable_radix_cache=True) as off:
        history: list[list[int]] = []
        for p in prompts:
            a, b = on.one(p, logprob=True), off.one(p, logprob=True)
            assert a.ids == b.ids, p
            assert a.cached == cacheable(history, p, len(p) - 1, ps), (len(p), history)
            assert b.cached == 0
            for x, y in zip(a.out_lps, b.out_lps):
                assert abs(x[0] - y[0]) < 1e-4
            check_greedy(a.ids, hf_greedy(hf, p, NEW), [lp[0] for lp in a.out_lps])
            history.append(p + a.ids[:-1])
        assert on.reported > 0


@pytest.mark.parametrize("ps", [1, 4])
def test_multi_turn_reuses_the_previous_turns_output(models, ps: int) -> None:
    """Each turn's prompt is the last turn's prompt, its answer and a new question: the hit
    covers the answer too, up to (not including) its last token, whose K/V was never
    computed. Lengths are chosen so that sequence ends fall on page boundaries."""
    path, hf = models["llama"]
    with engine(path, page_size=ps) as on, engine(path, page_size=ps,
                                                   disable_radix_cache=True) as off:
        history: list[list[int]] = []
        prompt = rand_ids(4 * ps, seed=50)
        for turn in range(4):
            a, b = on.one(prompt, sp=greedy(2 * ps)), off.one(prompt, sp=greedy(2 * ps))
            assert a.ids == b.ids
            assert a.cached == cacheable(history, prompt, len(prompt) - 1, ps)
            if turn:
                assert a.cached >= len(prompt) - ps - 1 - 3 * ps
            check_greedy(a.ids, hf_greedy(hf, prompt, 2 * ps))
            history.append(prompt + a.ids[:-1])
            prompt = prompt + a.ids + rand_ids(3 * ps, seed=60 + turn)


@pytest.mark.parametrize("ps", [4, 16])
def test_chunked_prefill_crossing_the_cached_boundary(models, ps: int) -> None:
    """Chunks of 10 (not page-aligned) start at the cached boundary; a second request arriving
    while the first is still in its chunked prefill takes the pages it has finished so far."""
    path, hf = models["llama"]
    warm = rand_ids(45, seed=1)
    later = warm[:37] + rand_ids(40, seed=2)
    long = rand_ids(90, seed=3)
    joiner = long[:50] + rand_ids(20, seed=4)
    res = {}
    for name, kw in (("on", {}), ("off", {"disable_radix_cache": True})):
        with engine(path, page_size=ps, chunked_prefill_size=10, **kw) as d:
            got = [d.one(warm), d.one(later)]
            r1 = d.req(long)
            d.step([r1])
            d.step()
            d.step()  # 30 of long's 90 prompt tokens computed, 28 (ps 4) or 16 (ps 16) cached
            r2 = d.req(joiner)
            got += d.run([r1, r2])
            res[name] = got
    on, off = res["on"], res["off"]
    assert [o.ids for o in on] == [o.ids for o in off]
    assert on[1].cached == 37 // ps * ps
    assert on[3].cached == 50 // ps * ps  # long was done by the time joiner ran
    for o, p in zip(on, (warm, later, long, joiner)):
        check_greedy(o.ids, hf_greedy(hf, p, NEW), [lp[0] for lp in o.out_lps])


def test_joiner_takes_pages_of_a_prefill_still_running(models) -> None:
    """With room for both in one step's budget, the second request is admitted while the first
    still has prompt chunks left: it takes exactly the full pages computed so far."""
    path, _ = models["llama"]
    long = rand_ids(120, seed=5)
    joiner = long[:100] + rand_ids(8, seed=6)
    res = {}
    for name, kw in (("on", {}), ("off", {"disable_radix_cache": True})):
        with engine(path, page_size=4, chunked_prefill_size=32, **kw) as d:
            r1 = d.req(long)
            d.step([r1])  # 32 computed
            d.step()  # 64 computed
            r2 = d.req(joiner)
            res[name] = d.run([r1, r2])
    assert [o.ids for o in res["on"]] == [o.ids for o in res["off"]]
    # admitted with the budget long's last chunk leaves: it takes the 96 tokens computed so far
    assert res["on"][1].cached == 96


def test_a_prefill_is_never_stalled_by_pages_its_own_copy_pins(models) -> None:
    """S and R share 8 tokens and prefill in one step, each its own copy; S's pages enter the
    tree first and R's later pages go below them. R must then use the tree's copy (freeing its
    own): otherwise S's pages, held by nobody, can never be evicted while R holds the pages
    below, and R, needing 9 of the 10 pages, waits forever for pages only it could free."""
    path, _ = models["llama"]
    s = rand_ids(8, seed=70)
    r = s + rand_ids(25, seed=71)
    res = {}
    for name, kw in (("on", {}), ("off", {"disable_radix_cache": True})):
        with engine(path, max_total_tokens=40, chunked_prefill_size=16, **kw) as d:
            res[name] = d.run([d.req(s, greedy(2)), d.req(r, greedy(3))], max_steps=200)
    assert [o.ids for o in res["on"]] == [o.ids for o in res["off"]]


@pytest.mark.parametrize("ps", [1, 4])
def test_identical_prompts_in_one_batch(models, ps: int) -> None:
    path, hf = models["qwen2"]
    p = rand_ids(33, seed=7)
    batch = [p] * 4 + [p[:20] + rand_ids(9, seed=8), p[:29] + rand_ids(3, seed=9)]
    with engine(path, page_size=ps) as on, engine(path, page_size=ps,
                                                   disable_radix_cache=True) as off:
        first = on.run([on.req(x) for x in batch])
        again = on.run([on.req(x) for x in batch])
        want = off.run([off.req(x) for x in batch])
        assert [o.ids for o in first] == [o.ids for o in want] == [o.ids for o in again]
        assert len({tuple(o.ids) for o in first[:4]}) == 1
        assert all(o.cached == 32 // ps * ps for o in again[:4])
        assert again[4].cached >= 20 // ps * ps and again[5].cached >= 29 // ps * ps
    check_greedy(first[0].ids, hf_greedy(hf, p, NEW), [lp[0] for lp in first[0].out_lps])


def test_prompt_logprobs_are_never_skipped(models) -> None:
    """A cached prefix covers only positions whose logprobs were not asked for."""
    path, _ = models["llama"]
    p = rand_ids(30, seed=10)
    with engine(path, page_size=4) as on, engine(path, disable_radix_cache=True) as off:
        on.one(p)
        for start in (0, 1, 5, 13, 29):
            kw = {"logprob": True, "logprob_start": start, "top": 3}
            a, b = on.one(p, **kw), off.one(p, **kw)
            assert a.cached == max(start - 1, 0) // 4 * 4
            assert a.ids == b.ids
            assert len(a.in_lps) == len(b.in_lps) == len(p) - start
            for x, y in zip(a.in_lps, b.in_lps):
                assert x[1] == y[1]  # the token
                if x[0] is None:
                    assert y[0] is None
                    continue
                assert abs(x[0] - y[0]) < 1e-4
                assert [t[1] for t in x[2]] == [t[1] for t in y[2]]  # the top-3 tokens
        a = on.one(p, logprob=True, logprob_start=-1)  # output logprobs only: a full hit
        assert a.cached == 28 and a.in_lps is None


def test_eviction_and_preemption_under_a_small_pool(models) -> None:
    path, _ = models["llama"]
    shared = rand_ids(24, seed=11)
    fill = [rand_ids(40, seed=20 + i) for i in range(4)]
    batch = [shared + rand_ids(16, seed=30 + i) for i in range(6)]
    sp = SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True)
    with engine(path, max_total_tokens=4096, disable_radix_cache=True) as big:
        want = [o.ids for o in big.run([big.req(x, sp) for x in fill + batch])]
    with engine(path, max_total_tokens=200) as small:  # 50 pages; the batch needs ~105
        got = [o.ids for o in small.run([small.req(x, sp) for x in fill])]
        assert small.eng.loop.stats()["radix_cache_pages"] > 0
        outs = small.run([small.req(x, sp) for x in batch])
        got += [o.ids for o in outs]
        stats = small.eng.loop.stats()
        assert stats["preempted_total"] > 0, stats
        assert stats["radix_cache_evicted_pages_total"] > 0, stats
        assert sum(o.cached for o in outs) > 0
    assert got == want


@pytest.mark.parametrize(("seed", "tp"), [(0, 1), (1, 1), (2, 1),
                                          pytest.param(3, 2, marks=pytest.mark.timeout(600))])
def test_random_arrivals_aborts_and_a_tight_pool(models, seed: int, tp: int) -> None:
    """Requests over shared prefixes arrive at random steps, some are aborted at random, the
    pool is small and chunks are short (eviction, preemption, hits on pages of running
    prefills, lpm): every request that ran to its end answers as it would alone without the
    cache, and nothing stays referenced. With TP 2 each rank keeps its own tree: any
    difference in what they match or evict would mix K/V of different pages."""
    import random

    path, _ = models["llama"]
    rng = random.Random(seed)
    bases = [rand_ids(48, seed=80 + 10 * seed + i) for i in range(3)]
    reqs: list[GenerateReq] = []
    aborted: set[str] = set()
    with engine(path, max_total_tokens=256, chunked_prefill_size=24, tp_size=tp,
                schedule_policy=rng.choice(["fcfs", "lpm"])) as d:
        for _ in range(300):
            new = []
            if len(reqs) < 30 and rng.random() < 0.3:
                for _ in range(rng.randrange(1, 4)):
                    p = rng.choice(bases)[:rng.randrange(1, 49)]
                    done = [r for r in reqs if d.outs[r.rid].done and r.rid not in aborted]
                    if done and rng.random() < 0.3:  # the next turn of a finished request
                        prev = rng.choice(done)
                        p = (prev.input_ids + d.outs[prev.rid].ids)[:100]
                    p = p + rand_ids(rng.randrange(0, 30), seed=rng.randrange(10 ** 6))
                    sp = SamplingParams(max_new_tokens=rng.randrange(1, 20), temperature=0.0,
                                        ignore_eos=True)
                    new.append(d.req(p, sp))
            live = [r for r in reqs if not d.outs[r.rid].done and r.rid not in aborted]
            if live and rng.random() < 0.05:
                victim = rng.choice(live)
                aborted.add(victim.rid)
                new.append(AbortReq(victim.rid))
            reqs += [m for m in new if isinstance(m, GenerateReq)]
            d.step(new)
        d.run(reqs)  # the rest run to their end
        stats = d.eng.loop.stats()
    kept = [r for r in reqs if r.rid not in aborted]
    with engine(path, disable_radix_cache=True) as off:
        want = off.run([off.req(r.input_ids, r.sampling) for r in kept])
    assert [d.outs[r.rid].ids for r in kept] == [o.ids for o in want]
    assert stats["cache_hit_tokens_total"] > 0 and stats["radix_cache_evicted_pages_total"] > 0


@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
def test_lpm_admits_the_longest_cached_prefix_first(models, policy: str) -> None:
    path, _ = models["llama"]
    warm = rand_ids(40, seed=12)
    a = rand_ids(40, seed=13)
    b = warm[:12] + rand_ids(28, seed=14)
    c = warm[:36] + rand_ids(4, seed=15)
    with engine(path, max_running_requests=1, schedule_policy=policy) as d, \
            engine(path, disable_radix_cache=True) as off:
        d.one(warm)
        outs = d.run([d.req(x) for x in (a, b, c)])
        want = off.run([off.req(x) for x in (a, b, c)])
    assert [o.ids for o in outs] == [o.ids for o in want]
    order = sorted("abc", key=lambda k: outs["abc".index(k)].first_step)
    assert "".join(order) == ("abc" if policy == "fcfs" else "cba")
    assert outs[2].cached == 36 and outs[1].cached == 12 and outs[0].cached == 0


# ---- pool hygiene -------------------------------------------------------------------------------
def test_flush_is_refused_while_a_request_is_in(models) -> None:
    path, _ = models["llama"]
    p = rand_ids(40, seed=16)
    with engine(path) as d:
        d.one(p)
        before = d.sched.cache.num_pages
        r = d.req(p, greedy(8))
        d.step([r])
        with pytest.raises(RuntimeError, match="cannot flush the prefix cache: 1 requests"):
            d.sched.flush_cache()
        assert d.sched.cache.num_pages >= before  # nothing was dropped
        d.run([r])
        freed = d.sched.flush_cache()
        assert freed["flushed"] is True and freed["freed_pages"] > 0
        assert d.sched.blocks.num_free == d.sched.blocks.num_pages
        assert d.one(p).cached == 0  # an empty tree: nothing to match


def test_aborts_of_shared_prefix_requests_leave_the_pool_at_rest(models) -> None:
    path, _ = models["llama"]
    shared = rand_ids(30, seed=17)
    prompts = [shared + rand_ids(60, seed=40 + i) for i in range(3)]
    with engine(path, chunked_prefill_size=16) as d, \
            engine(path, disable_radix_cache=True) as off:
        d.one(shared + rand_ids(3, seed=18))
        reqs = [d.req(x, greedy(40)) for x in prompts]
        d.step(reqs)  # reqs[0] prefills its first chunk, the others wait
        d.step([AbortReq(reqs[1].rid)])  # waiting with nothing computed
        for _ in range(20):
            d.step()
        assert not d.outs[reqs[2].rid].done
        d.step([AbortReq(reqs[2].rid)])  # in prefill or decode, holding cached pages
        d.run([reqs[0]])
        assert d.outs[reqs[1].rid].done and d.outs[reqs[2].rid].done
        assert pages_at_rest(d.sched)
        again = d.one(prompts[2])
        assert again.cached >= 28
        assert again.ids == off.one(prompts[2]).ids


def test_smollm2_shared_system_prompt_matches_transformers(smollm2_hf, smollm2_tokenizer,
                                                           monkeypatch):
    monkeypatch.setenv("PDCORE_GGUF_PACKED", "0")  # de-quantized: transformers' numerics
    system = {"role": "system", "content": "You are a careful assistant. Answer in one short "
              "sentence, and never use more words than the question needs."}
    questions = ["What is the capital of France?", "Name a primary color.",
                 "What is 3 + 4?"]
    prompts = []
    for q in questions:
        ids = smollm2_tokenizer.apply_chat_template([system, {"role": "user", "content": q}],
                                                    add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    eng = LLMEngine(ServerArgs(max_total_tokens=4096, page_size=16))
    try:
        d = Driver(eng)
        outs = [d.one(p, sp=greedy(24)) for p in prompts + prompts[:1]]
        assert all(o.cached > 0 for o in outs[1:])
        assert outs[3].ids == outs[0].ids
        assert pages_at_rest(eng.scheduler)
    finally:
        eng.close()
    for o, p in zip(outs, prompts):
        check_greedy(o.ids, hf_greedy(smollm2_hf, p, 24), [lp[0] for lp in o.out_lps])
