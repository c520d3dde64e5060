"""The scheduler's KV pages: allocation that evicts unlocked prefix-cache pages when it must,
and the requests' share of the prefix cache (offering computed pages, taking a cached prefix,
releasing)."""

from __future__ import annotations

from pdcore.engine.kv.blocks import BlockManager
from pdcore.engine.kv.radix import RadixCache
from pdcore.engine.sched.request import Req

# tokens of cached pages evicted beyond an allocation's shortfall (see KVPages.can_alloc): at
# page size 1 and a full 40k-page pool, evicting only the shortfall walked every cached page
# once per running request per decode step (TPOT 74 -> 166-251 ms in bench/goodput.py, s9)
EVICT_AHEAD_TOKENS = 256


class KVPages:
    def __init__(self, blocks: BlockManager, tree: RadixCache | None) -> None:
        self.blocks = blocks
        self.tree = tree  # the prefix cache; None: --disable-radix-cache

    def can_alloc(self, n: int) -> bool:
        """Can n pages be allocated now, evicting unlocked cached pages if that is needed.

        At a full pool every decode step needs a page per running request (page size 1), so
        eviction frees EVICT_AHEAD_TOKENS more than the shortfall where it can (at most 1/128
        of the pool): the next allocations then find free pages instead of each walking the
        tree again."""
        free = self.blocks.num_free
        need = n - free
        # evict only when that makes room: a request that cannot fit yet must not empty the
        # cache every step while it waits
        if need > 0 and self.tree is not None:
            ahead = need + min(EVICT_AHEAD_TOKENS // self.blocks.page_size,
                               self.blocks.num_pages // 128)  # small pools: the shortfall only
            can = self.tree.evictable(at_least=ahead)
            if can >= need:
                self.tree.evict(min(can, ahead))
        return self.blocks.can_alloc(n)

    def alloc(self, n: int) -> list[int]:
        if not self.can_alloc(n):
            raise MemoryError(f"need {n} KV pages, {self.blocks.num_free} free")
        return self.blocks.alloc(n)

    def cache(self, req: Req, adopt: bool = False) -> None:
        """Offer the request's computed full pages to the prefix cache. With `adopt` (a request
        that goes on running), pages the tree already held under other ids replace its own
        copies, which return to the pool: its pages stay a root path of the tree, so no leaf
        it holds pins ancestors that nobody holds (such pinned pages are neither free nor
        evictable; a prefill that needs them would wait forever for its own end)."""
        if self.tree is None or not req.pages or req.error is not None:
            return
        n = min(req.num_computed, req.seq_len)
        tokens = [req.token_at(p) for p in range(n)]
        self.tree.insert(tokens, req.pages)
        if not adopt:
            return
        for i, page in enumerate(self.tree.match(tokens, n)):
            if req.pages[i] != page:
                self.blocks.free([req.pages[i]])
                req.pages[i] = self.blocks.ref([page])[0]
                req.ctx_slots = None  # the slot table is rebuilt from the pages

    def attach_prefix(self, req: Req, limit: int) -> int:
        """Give a request without pages the cached pages of its sequence's longest prefix
        (at most `limit` tokens, whole pages); they stay locked (referenced) until it frees
        them. Returns the tokens they hold."""
        if self.tree is None or req.pages or limit < self.blocks.page_size:
            return 0
        tokens = req.prompt[:limit] if limit <= len(req.prompt) else req.prompt + req.output
        req.pages = self.blocks.ref(self.tree.match(tokens, limit))
        req.ctx_slots = None
        return len(req.pages) * self.blocks.page_size

    def match_limit(self, req: Req) -> int:
        """The positions a request may take from the cache: never the last one (its logits
        are needed), nor any whose prompt logprobs it asked for."""
        limit = req.seq_len - 1
        if req.wants_prompt_logprobs:
            limit = min(limit, max(req.logprob_start_len - 1, 0))
        return limit

    def release(self, req: Req) -> None:
        if req.pages:
            self.cache(req)
            self.blocks.free(req.pages)
        req.pages, req.ctx_slots, req.num_computed = [], None, 0

    def ensure(self, req: Req, upto: int) -> bool:
        need = self.blocks.pages_for(upto) - len(req.pages)
        if need <= 0:
            return True
        if not self.can_alloc(need):
            return False
        req.pages.extend(self.blocks.alloc(need))
        return True

    def for_drafts(self, req: Req, reserve: int) -> int:
        """Pages for the request's draft tokens (speculative decoding) from those free now,
        leaving `reserve` free: drafts never evict the prefix cache or preempt anyone. Drafts
        that do not fit are cut (halved until they do); returns how many are kept."""
        drafts = req.drafts
        while drafts:
            need = self.blocks.pages_for(req.num_computed + 1 + len(drafts)) - len(req.pages)
            if need <= 0 or self.blocks.can_alloc(need + reserve):
                if need > 0:
                    req.pages.extend(self.blocks.alloc(need))
                break
            drafts = drafts[: len(drafts) // 2]
        if req.spec is not None:
            req.spec.drafts = drafts
        return len(drafts)

    def trim(self, req: Req) -> None:
        """After a verify: the slot table back to the computed positions, and the pages beyond
        the sequence (rejected drafts') back to the pool."""
        if req.ctx_slots is not None:
            req.ctx_slots = req.ctx_slots[: req.num_computed]
        keep = self.blocks.pages_for(req.seq_len)
        if len(req.pages) > keep:
            self.blocks.free(req.pages[keep:])
            del req.pages[keep:]
