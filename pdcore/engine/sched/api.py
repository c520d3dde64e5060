"""What a role extension (pdcore.engine.sched.extension) may do to the scheduler it is attached to:
admit and hold a request, resume it into the queue or the running batch, finish or fail it,
hand it a token computed elsewhere, give a held request pages or take them from it (a request's
page list changes only here and in the scheduler), read the pool, and hand over or adopt a
draft head's chain start (PD: P's is D's first drafts). No extension touches
the scheduler's queues, page manager or config itself, so the scheduler keeps its invariants
(a request is in at most one queue; its pages are freed once) and knows nothing of the roles.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pdcore.engine.sched.eagle import ChainStart
from pdcore.engine.sched.fork import follower_pages, fork
from pdcore.engine.sched.request import Phase, Req
from pdcore.engine.sched.speculative import ReqSpec

if TYPE_CHECKING:
    import torch

    from pdcore.engine.model.layers import TPInfo
    from pdcore.engine.sched.extension import HeadChain, ModelSide
    from pdcore.engine.sched.scheduler import Scheduler


class SchedulerAPI:
    """What a role extension may do to the scheduler it is attached to."""

    def __init__(self, sched: Scheduler) -> None:
        self._s = sched

    # ---- requests -------------------------------------------------------------------------
    def hold(self, req: Req) -> None:
        """The extension owns `req` (out of every queue, its pages kept) until it resumes,
        completes or fails it. Its tokens are not sent while it is held."""
        s = self._s
        if req in s.running:
            s.running.remove(req)
        elif req in s.waiting:
            s.waiting.remove(req)
        req.phase = Phase.HELD

    def resume(self, req: Req, front: bool = False) -> None:
        """A held request joins the waiting queue (to be filled from what it has computed)."""
        self._s.enqueue(req, front)

    def run(self, req: Req, computed: int) -> None:
        """A held request joins the running batch as is: the K/V of its first `computed`
        positions is in its pages already (written by a peer, or forked)."""
        req.num_computed = computed
        req.phase = Phase.RUNNING
        self._s.running.append(req)

    def complete(self, req: Req) -> None:
        """A held request that already finished is done: its final output goes out, its pages
        are freed."""
        self._s.drop(req)

    def fail(self, req: Req, message: str, status: int = 500, code: str | None = None) -> None:
        """End `req` with an error: its HTTP status and, when a caller acts on the reason, its
        code (pdcore.messages.codes.ErrorCode)."""
        self._s.fail(req, message, status, code)

    def push_token(self, req: Req, token: int, logprob: Any = None) -> None:
        """A token computed elsewhere (PD decode: P's first token); finish checks apply."""
        self._s.push_token(req, token, logprob)

    def find(self, rid: str) -> Req | None:
        return self._s.reqs.get(rid)

    def live(self) -> list[Req]:
        return [r for r in self._s.reqs.values() if r.phase is not Phase.FINISHED]

    def occupancy(self) -> int:
        """Requests in the running batch or the waiting queue."""
        return len(self._s.running) + len(self._s.waiting)

    @property
    def max_running(self) -> int:
        return self._s.cfg.max_running

    @property
    def tp_group(self) -> TPInfo:
        """The TP group this scheduler's ranks form (an extension agrees on its states over it)."""
        return self._s.tp

    def now(self) -> float:
        return self._s.now()

    # ---- pages ----------------------------------------------------------------------------
    @property
    def page_size(self) -> int:
        return self._s.blocks.page_size

    @property
    def num_pages(self) -> int:
        return self._s.blocks.num_pages

    def pages_for(self, tokens: int) -> int:
        return self._s.blocks.pages_for(tokens)

    def can_alloc(self, pages: int) -> bool:
        """Free pages enough (the prefix cache gives back unlocked pages when needed)."""
        return self._s.pages.can_alloc(pages)

    def attach_prefix(self, req: Req, limit: int) -> int:
        """Lock the cached pages of the longest prefix of `req`'s prompt (at most `limit`
        tokens, whole pages) as the first of its pages; returns the tokens they hold (0: no
        cache, or no hit). The request must hold no pages yet."""
        return self._s.pages.attach_prefix(req, limit)

    @property
    def has_cache(self) -> bool:
        return self._s.cache is not None

    def free_pages(self, pages: list[int]) -> None:
        """Pages no request holds any more (taken with `take_pages`) go back to the pool."""
        self._s.blocks.free(pages)

    def extend_pages(self, req: Req, tokens: int) -> None:
        """`req` (held) gets pages enough for its first `tokens` positions, after those it has;
        MemoryError when the pool cannot give them (ask `can_alloc` first)."""
        if not self._s.pages.ensure(req, tokens):
            raise MemoryError(f"{req.rid}: no free KV pages for {tokens} tokens")

    def drop_pages(self, req: Req) -> None:
        """`req` (held) frees every page it holds and holds none (a cached prefix it took is
        matched again when it tries again)."""
        pages = self.take_pages(req)
        if pages:
            self._s.blocks.free(pages)

    def take_pages(self, req: Req) -> list[int]:
        """`req` (held) gives up its pages without freeing them: the caller owns them now and
        frees them (`free_pages`) once nothing may write into them any more (PD decode: a peer
        still writing into an aborted request's pages)."""
        pages = req.pages
        req.pages, req.ctx_slots = [], None
        return pages

    def follower_pages(self, prompt_len: int, extra_tokens: int) -> int:
        return follower_pages(self._s.blocks, prompt_len, extra_tokens)

    def fork(self, leader: Req, follower: Req) -> bool:
        """Give a parallel sample its leader's prompt KV (pdcore.engine.sched.fork)."""
        return fork(self._s.blocks, self._side.kv_layers, leader, follower)

    # ---- a draft head's chain start (engine/sched/eagle.py: ChainStart) ---------------------
    @property
    def _side(self) -> ModelSide:
        side = self._s.side
        if side is None:
            raise RuntimeError("the scheduler was built without its model side")
        return side

    def _chain(self) -> HeadChain | None:
        return self._s.side.chain if self._s.side is not None else None

    def chain_geometry(self) -> tuple[int, torch.dtype, int] | None:
        """(hidden size, dtype, vocabulary) of the chain starts this server's draft head makes
        and continues from; None without a head (no speculation, NGRAM)."""
        c = self._chain()
        if c is None:
            return None
        side = self._side
        return side.hidden_size, c.dtype, side.vocab_size

    def chain_start(self, req: Req) -> tuple[int, torch.Tensor] | None:
        """(first draft token, the head's output vector) the draft head made for `req` once
        its whole prompt was computed, with the first output token (P's last chunk), or None."""
        st = req.spec.draft if req.spec is not None else None
        if isinstance(st, ChainStart) and st.at == len(req.prompt) == req.num_computed:
            return st.token, st.hidden
        return None

    def adopt_chain_start(self, req: Req, token: int, hidden: torch.Tensor) -> bool:
        """`req` runs from its prompt's K/V (and its draft head's) written elsewhere: its next
        step drafts from this chain start (the token after the first output token, and the
        head's output vector it is fed with). False without a head."""
        c = self._chain()
        if c is None:
            return False
        if req.spec is None:
            req.spec = ReqSpec(cap=c.max_drafts)
        req.spec.draft = ChainStart(len(req.prompt), int(token),
                                    hidden.to(device=c.device, dtype=c.dtype, copy=True))
        return True
