"""The prefix cache's radix tree (pdcore.engine.kv.radix) against a reference model, no model
involved: a dict from page-aligned token prefix to the page holding that prefix's last page.

Every check runs at page sizes 1, 4 and 16. Holders stand in for requests: they take a reference
on matched pages, allocate their own for the rest, offer their full pages to the tree (after a
"chunk" and at the end) and free their references when they finish, as the scheduler does.
"""

from __future__ import annotations

import copy
import random

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from pdcore.engine.kv.blocks import BlockManager
from pdcore.engine.kv.radix import RadixCache
from pdcore.engine.sched.pages import KVPages

PAGE_SIZES = [1, 4, 16]


# ---- helpers ------------------------------------------------------------------------------------
def tree_dict(cache: RadixCache) -> dict[tuple[int, ...], int]:
    """What the tree lists: page-aligned prefix -> the page holding its last page of tokens."""
    ps, out = cache.ps, {}
    stack: list[tuple[object, tuple[int, ...]]] = [(cache.root, ())]
    while stack:
        node, prefix = stack.pop()
        for k, page in enumerate(node.pages):  # type: ignore[attr-defined]
            key = prefix + tuple(node.key[:(k + 1) * ps])  # type: ignore[attr-defined]
            assert key not in out, f"prefix of {len(key)} tokens listed twice"
            out[key] = page
        full = prefix + tuple(node.key)  # type: ignore[attr-defined]
        for head, child in node.children.items():  # type: ignore[attr-defined]
            assert child.parent is node and tuple(child.key[:ps]) == head and child.pages
            stack.append((child, full))
    return out


def page_keys(tokens: list[int], ps: int) -> list[tuple[int, ...]]:
    """The prefixes ending at each full page of `tokens`."""
    return [tuple(tokens[:(i + 1) * ps]) for i in range(len(tokens) // ps)]


def longest_cached(ref: dict[tuple[int, ...], int], tokens: list[int], limit: int,
                   ps: int) -> list[int]:
    out = []
    for key in page_keys(tokens[:limit], ps):
        if key not in ref:
            break
        out.append(ref[key])
    return out


def ref_evictable(ref: dict[tuple[int, ...], int], blocks: BlockManager) -> set[int]:
    """Pages only the tree holds, none of whose cached extensions a holder references."""
    locked = [k for k, p in ref.items() if blocks.refcount(p) != 1]
    return {p for k, p in ref.items()
            if blocks.refcount(p) == 1 and not any(lk[:len(k)] == k for lk in locked)}


def seq(ps: int, pages: list[int], tail: int = 0) -> list[int]:
    """Tokens of whole pages drawn from three patterns (0 and 1 differ only in their last
    token, so a page that shares all but one token must not match) plus `tail` extra tokens."""
    pats = [[7] * ps, [7] * (ps - 1) + [8], [9] * ps]
    out = [t for p in pages for t in pats[p]]
    return out + [5] * tail


# ---- fixed scenarios ----------------------------------------------------------------------------
@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_insert_match_split_and_partial_pages(ps: int) -> None:
    blocks = BlockManager(32, ps)
    cache = RadixCache(blocks)
    a = seq(ps, [0, 0, 1], tail=ps - 1)
    pa = blocks.alloc(blocks.pages_for(len(a)))
    assert cache.insert(a, pa) == 3  # the partial last page stays out
    blocks.free(pa)
    assert all(blocks.refcount(p) == 0 for p in pa[3:])
    assert all(blocks.refcount(p) == 1 for p in pa[:3])
    assert cache.match(a, len(a)) == pa[:3]
    assert cache.match(a, 3 * ps - 1) == pa[:2]  # limit cuts inside page 3: whole pages only
    assert cache.match(a, ps - 1) == []
    # b shares the first page, then differs in one token of page 2: the node splits after 1
    b = seq(ps, [0, 1, 2])
    pb = blocks.alloc(3)
    assert cache.insert(b, pb) == 2
    blocks.free(pb)
    assert blocks.refcount(pb[0]) == 0  # page 1 was cached already (as pa[0]): not taken
    assert cache.match(b, len(b)) == [pa[0], pb[1], pb[2]]
    assert cache.match(a, len(a)) == pa[:3]
    assert len(cache.root.children) == 1
    trunk = next(iter(cache.root.children.values()))
    assert trunk.pages == [pa[0]] and len(trunk.children) == 2
    assert cache.num_pages == 5 == len(tree_dict(cache))
    # re-inserting a cached sequence under other page ids takes nothing
    pc = blocks.alloc(3)
    assert cache.insert(b, pc) == 0
    blocks.free(pc)
    assert blocks.num_free + cache.num_pages == blocks.num_pages
    # evicting leaves first: the trunk goes only with both of its children
    assert cache.evictable() == 5
    assert cache.evict(4) == 4
    assert cache.num_pages == 1 and cache.match(a, len(a)) == [pa[0]]
    assert cache.evict(10) == 1 and cache.num_pages == 0
    assert blocks.num_free == blocks.num_pages and cache.root.children == {}


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_eviction_is_lru_and_never_takes_a_held_page(ps: int) -> None:
    blocks = BlockManager(16, ps)
    cache = RadixCache(blocks)
    pages = {}
    for name, pat in (("a", [0, 0]), ("b", [1, 1, 1]), ("c", [2, 2])):
        pages[name] = blocks.alloc(len(pat))
        cache.insert(seq(ps, pat), pages[name])
        blocks.free(pages[name])
    cache.match(seq(ps, [0, 0]), 2 * ps)  # a is now the most recently used
    assert cache.evict(3) == 3  # b, the least recently used, goes whole
    assert all(blocks.refcount(p) == 0 for p in pages["b"])
    assert cache.evict(1) == 1  # then c's last page (a leaf's tail first)
    assert blocks.refcount(pages["c"][1]) == 0 and blocks.refcount(pages["c"][0]) == 1
    # a holder locks a's first page: a's second page may go, its first never
    held = blocks.ref(cache.match(seq(ps, [0, 0]), 2 * ps - 1))
    assert held == pages["a"][:1]
    assert cache.evictable() == 2  # c[0] and a[1]
    assert cache.evict(10 ** 9) == 2
    assert blocks.refcount(held[0]) == 2 and cache.num_pages == 1
    assert cache.evict(5) == 0 and cache.evictable() == 0
    blocks.free(held)
    assert cache.evictable() == 1
    assert cache.reset() == 1 and blocks.num_free == blocks.num_pages
    assert cache.match(seq(ps, [0, 0]), 2 * ps) == [] and cache.num_pages == 0


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_a_held_leaf_keeps_its_unheld_ancestors(ps: int) -> None:
    """A request's own pages can enter the tree below pages it does not hold (it computed the
    prefix itself, alongside another request); the ancestors, only the tree's, must stay."""
    blocks = BlockManager(16, ps)
    cache = RadixCache(blocks)
    first = blocks.alloc(2)
    second = blocks.alloc(3)  # a request that computed the same two pages and one more
    cache.insert(seq(ps, [0, 1]), first)
    blocks.free(first)
    assert cache.insert(seq(ps, [0, 1, 2]), second) == 1
    assert cache.evictable() == 0  # the leaf is held by `second`; its ancestors wait for it
    assert cache.evict(10) == 0
    assert cache.match(seq(ps, [0, 1, 2]), 3 * ps) == first + second[2:]
    blocks.free(second)
    assert blocks.num_free + cache.num_pages == blocks.num_pages
    assert cache.evictable() == 3 and cache.evict(10 ** 9) == 3


# ---- randomized against the reference -----------------------------------------------------------
class TreeMachine(RuleBasedStateMachine):
    """Holders (requests) come and go over a small pool; after every rule the tree lists exactly
    the reference's prefixes and every page's reference count is the tree's plus its holders'."""

    PS = 4
    POOL = 20

    @initialize()
    def setup(self) -> None:
        self.blocks = BlockManager(self.POOL, self.PS)
        self.cache = RadixCache(self.blocks)
        self.ref: dict[tuple[int, ...], int] = {}
        self.holders: list[tuple[list[int], list[int]]] = []  # (tokens, pages held)

    def _insert(self, tokens: list[int], pages: list[int]) -> None:
        new = 0
        for key, page in zip(page_keys(tokens, self.PS), pages):
            if key not in self.ref:
                self.ref[key] = page
                new += 1
        assert self.cache.insert(tokens, pages) == new

    @rule(pats=st.lists(st.integers(0, 2), min_size=0, max_size=5),
          tail=st.integers(0, 15), cut=st.integers(0, 100), chunk=st.booleans())
    def admit(self, pats: list[int], tail: int, cut: int, chunk: bool) -> None:
        """A request matches a prefix (limited like the scheduler's _match_limit), allocates the
        rest (evicting if it must) and, if `chunk`, offers a first chunk's full pages."""
        tokens = seq(self.PS, pats, tail % self.PS)
        if not tokens:
            return
        limit = min(len(tokens) - 1, cut * len(tokens) // 100)
        got = self.cache.match(tokens, limit)
        assert got == longest_cached(self.ref, tokens, limit, self.PS)
        pages = self.blocks.ref(got)
        need = self.blocks.pages_for(len(tokens)) - len(pages)
        if need > self.blocks.num_free:
            self._evict(need - self.blocks.num_free)
        if need > self.blocks.num_free:
            self.blocks.free(pages)  # no room: give the matched pages back
            return
        pages += self.blocks.alloc(need)
        self.holders.append((tokens, pages))
        if chunk:
            done = len(got) * self.PS + (len(tokens) - len(got) * self.PS) // 2
            self._insert(tokens[:done], pages)

    @precondition(lambda self: self.holders)
    @rule(i=st.integers(0, 100))
    def finish(self, i: int) -> None:
        tokens, pages = self.holders.pop(i % len(self.holders))
        self._insert(tokens, pages)
        self.blocks.free(pages)

    @rule(pats=st.lists(st.integers(0, 2), min_size=0, max_size=6), tail=st.integers(0, 15))
    def match_only(self, pats: list[int], tail: int) -> None:
        tokens = seq(self.PS, pats, tail % self.PS)
        assert self.cache.match(tokens, len(tokens)) == longest_cached(
            self.ref, tokens, len(tokens), self.PS)

    def _evict(self, want: int) -> None:
        can = ref_evictable(self.ref, self.blocks)
        listed = dict(self.ref)
        freed = self.cache.evict(want)
        assert freed == min(want, len(can))
        after = tree_dict(self.cache)
        gone = {p for k, p in listed.items() if k not in after}
        assert len(gone) == freed and gone <= can  # only pages no holder references
        assert all(self.blocks.refcount(p) == 0 for p in gone)
        self.ref = {k: p for k, p in self.ref.items() if k in after}

    @rule(want=st.integers(0, 8))
    def evict(self, want: int) -> None:
        self._evict(want)

    @precondition(lambda self: not self.holders)
    @rule()
    def reset(self) -> None:
        assert self.cache.reset() == len(self.ref)
        self.ref = {}
        assert self.blocks.num_free == self.POOL and self.cache.match([7] * 64, 64) == []

    @invariant()
    def tree_equals_reference(self) -> None:
        assert tree_dict(self.cache) == self.ref
        assert self.cache.num_pages == len(self.ref)

    @invariant()
    def refcounts_exact(self) -> None:
        count = [0] * self.POOL
        for p in self.ref.values():
            count[p] += 1
        for _, pages in self.holders:
            for p in pages:
                count[p] += 1
        assert [self.blocks.refcount(p) for p in range(self.POOL)] == count
        assert self.blocks.num_free == count.count(0)  # nothing referenced is free
        if not self.holders:
            assert self.blocks.num_free + self.cache.num_pages == self.POOL

    @invariant()
    def evictable_is_what_evict_all_frees(self) -> None:
        can = ref_evictable(self.ref, self.blocks)
        assert self.cache.evictable() == len(can)
        for k in (0, 1, 2, 5, len(can), len(can) + 1):  # the early stop answers the same test
            got = self.cache.evictable(at_least=k)
            assert got <= len(can) and (got >= k) == (len(can) >= k), (k, got, len(can))
        twin = copy.deepcopy(self.cache)  # copies the BlockManager with it
        assert twin.evict(10 ** 9) == len(can)
        assert twin.blocks.num_free == self.blocks.num_free + len(can)


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_tree_against_reference(ps: int) -> None:
    machine = type(f"TreeMachinePs{ps}", (TreeMachine,), {"PS": ps})
    run_state_machine_as_test(machine, settings=settings(max_examples=60, stateful_step_count=40,
                                                         deadline=None))


@pytest.mark.parametrize("ps", PAGE_SIZES)
@pytest.mark.parametrize("seed", range(4))
def test_lru_order_against_reference(ps: int, seed: int) -> None:
    """Sequences with distinct first pages (one tree branch each): eviction takes the least
    recently used branch's unheld tail pages first, exactly."""
    rng = random.Random(seed)
    n_seq = 6
    blocks = BlockManager(64, ps)
    cache = RadixCache(blocks)
    seqs = [[100 + j] * ps + [rng.randrange(3) for _ in range(rng.randrange(0, 4) * ps)]
            for j in range(n_seq)]
    pages: dict[int, list[int]] = {}  # cached pages of each sequence, in order
    last: dict[int, int] = {}
    holders: list[tuple[int, list[int]]] = []
    for step in range(200):
        op = rng.random()
        j = rng.randrange(n_seq)
        n_pages = len(seqs[j]) // ps
        cached = len(pages.get(j, []))
        if op < 0.3 and cached in (0, n_pages):
            own = blocks.alloc(n_pages)
            assert cache.insert(seqs[j], own) == n_pages - cached
            if cached == 0:
                pages[j] = own[:]
            blocks.free(own)
            last[j] = step
        elif op < 0.55:
            limit = rng.randrange(len(seqs[j]) + 1)
            got = cache.match(seqs[j], limit)
            assert got == pages.get(j, [])[:limit // ps]
            if got:
                last[j] = step
                if rng.random() < 0.5:
                    holders.append((j, blocks.ref(got)))
        elif op < 0.7 and holders:
            _, held = holders.pop(rng.randrange(len(holders)))
            blocks.free(held)
        else:
            want = rng.randrange(1, 6)
            expect: list[int] = []
            for k in sorted((k for k in pages if pages[k]), key=lambda k: last[k]):
                locked = max((len(h) for hj, h in holders if hj == k), default=0)
                take = min(len(pages[k]) - locked, want - len(expect))
                if take > 0:
                    expect += pages[k][len(pages[k]) - take:]
                    pages[k] = pages[k][:len(pages[k]) - take]
            free_before = blocks.num_free
            assert cache.evict(want) == len(expect)
            assert all(blocks.refcount(p) == 0 for p in expect)
            assert blocks.num_free == free_before + len(expect)
            pages = {k: v for k, v in pages.items() if v}
        assert cache.num_pages == sum(len(v) for v in pages.values())
    for _, held in holders:
        blocks.free(held)
    assert blocks.num_free + cache.num_pages == blocks.num_pages
    assert cache.evictable() == cache.num_pages
    assert cache.reset() == sum(len(v) for v in pages.values())
    assert blocks.num_free == blocks.num_pages


class CountingBlocks(BlockManager):
    """Counts reference reads: what the eviction walk costs at a full pool."""

    reads = 0

    def refcount(self, page: int) -> int:
        self.reads += 1
        return super().refcount(page)


def full_pool(num_pages: int, seq_len: int) -> tuple[CountingBlocks, RadixCache, KVPages]:
    """A page-size-1 pool filled by the cached pages of finished requests (random tokens, as a
    serving mix's prompts), none held."""
    blocks = CountingBlocks(num_pages, 1)
    cache = RadixCache(blocks)
    rng = random.Random(0)
    while blocks.num_free >= seq_len:
        pages = blocks.alloc(seq_len)
        cache.insert([rng.randrange(1, 50_000) for _ in range(seq_len)], pages)
        blocks.free(pages)
    return blocks, cache, KVPages(blocks, cache)


def test_decode_allocations_at_a_full_pool_do_not_walk_every_cached_page() -> None:
    """Each running request takes one page a decode step; at a full pool each of those used to
    count every cached page's reference (evictable()) and evict exactly one: 40k reads per
    request per step at a 40k-page pool (TPOT 74 -> 166-251 ms in s9's goodput runs)."""
    blocks, cache, pages = full_pool(8192, 256)
    cached = cache.num_pages
    assert cached >= 8000 and blocks.num_free < 256
    held = blocks.alloc(blocks.num_free)
    blocks.reads = 0
    steps, batch = 16, 32
    for _ in range(steps):
        for _ in range(batch):
            assert pages.can_alloc(1)
            held += blocks.alloc(1)
    # evicting ahead (64 pages here: 1/128 of the pool) leaves free pages for the next
    # allocations; the stopped count reads a leaf or two per eviction, not the pool
    assert blocks.reads < 20 * cached // 8, blocks.reads
    assert cache.evicted_pages == steps * batch + blocks.num_free
    assert blocks.num_free < 8192 // 128  # never more than one batch ahead
    assert blocks.num_free + cache.num_pages + len(held) == blocks.num_pages


def test_eviction_ahead_spares_small_pools_and_unfit_requests() -> None:
    """A pool under 128 pages evicts exactly the shortfall, as before; a shortfall the cache
    cannot cover evicts nothing (a waiting request must not empty the cache every step)."""
    blocks, cache, pages = full_pool(120, 10)
    held = blocks.alloc(blocks.num_free)
    before = cache.num_pages
    assert pages.can_alloc(3) and blocks.num_free == 3 and cache.num_pages == before - 3
    held += blocks.alloc(3)
    assert not pages.can_alloc(cache.num_pages + 1)
    assert cache.num_pages == before - 3 and blocks.num_free == 0
    blocks.free(held)
