"""Multi-layer MTP chains (`--enable-multi-layer-eagle`): a draft head of N >= 2 layers (a MiMo
checkpoint's own MTP layers, engine/model/mimo.py), HeadDrafter (engine/sched/eagle.py)
generalised so that chain step j runs layer min(j, N - 1), each layer over its OWN K/V pool.

Layer j at position p reads the pair (layer j-1's output at p, token t_{p+1+j}), the target's
final-norm hidden state standing in for layer -1, and scores t_{p+2+j} (mimo.py). So layer j can
compute position p for real only once t_{p+1+j} is known: it lags j positions behind the target.

- `observe` (after every target forward that computed positions [a, at)): layer 0 runs over
  [a, at) as a one-layer head does; then layer j = 1..N-1 over the positions from where it
  stopped (`done[j]`) up to at - j (and no further than layer j-1's real outputs), batched over
  the step's requests. Every row stands on known tokens only, so each layer's pool holds exactly
  what running it from scratch over the sequence gives (K/V at the target's slots: in the
  request's pages, freed and shared with them; a PD pair moves all N pools, one more KV layer
  each, `KVLayout.draft_layers` N). The layer j-1 outputs that layer j has not read yet (one
  row in the steady state) are kept with the chain start (`MTPStart.feed`).
- `propose`: d_1 is layer 0's argmax at at - 1. Step j <= N - 1 runs layer j over positions
  [done[j], at) (about j rows a request: its lag, now with the drafts d_1..d_j as the unknown
  tokens) on scratch slots past the pool; its output at at - 1 gives d_{j+1}. Steps beyond
  N - 1 continue with the last layer one position further each step, fed its own previous
  output (as a one-layer EAGLE chain does). Chain K/V are scratch: the verify decides.
- Where a layer's context K/V is missing: a request's first observe (after admission, a prefix
  cache hit, a preemption, a failed draft pass, or on a PD decode server, whose prompt P
  observed) starts every layer at the first position the target computes, so layer j lacks
  its own K/V for the last j positions before it (the pool holds whatever those slots had:
  what an earlier request or P wrote there, else zeros). Drafts are then a little worse; the
  greedy identity holds regardless, since the verify decides every token.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pdcore.engine.model.batch import SeqSpan
from pdcore.engine.sched.draft_tp import DraftsDropped
from pdcore.engine.sched.eagle import ChainStart, DraftHead, HeadDrafter, Pairs, observe_pass
from pdcore.engine.sched.speculative import ReqSpec

if TYPE_CHECKING:
    from pdcore.engine.kv.blocks import BlockManager
    from pdcore.engine.model.layers import TPInfo
    from pdcore.engine.model.runner import ModelRunner
    from pdcore.engine.sched.batch_run import StepResult
    from pdcore.engine.sched.request import Req

log = logging.getLogger(__name__)


@dataclass
class MTPStart(ChainStart):
    """A chain start of a multi-layer head, with where each layer j >= 1 stands: its pool holds
    positions < done[j]; feed[j] is layer j-1's outputs at [done[j], done[j-1]) (done[0] = at),
    which layer j reads next."""

    done: list[int]
    feed: list[torch.Tensor]


def _layers_of(st: ChainStart, n: int) -> tuple[list[int], list[torch.Tensor]]:
    """(done, feed) of a chain start valid at st.at: a one-layer ChainStart (from elsewhere)
    reads as every layer j >= 1 standing one position back, fed layer 0's output there."""
    if isinstance(st, MTPStart) and len(st.done) == n:
        return list(st.done), list(st.feed)
    empty = st.hidden.new_empty((0, st.hidden.shape[-1]))
    return [st.at] + [st.at - 1] * (n - 1), [empty, st.hidden[None]] + [empty] * (n - 2)


class MultiLayerDrafter(HeadDrafter):
    def __init__(self, head: DraftHead, blocks: BlockManager, max_running: int,
                 max_drafts: int, alloc: Callable[..., torch.Tensor] | None = None, *,
                 tp: TPInfo | None = None, runner: ModelRunner | None = None) -> None:
        super().__init__(head, blocks, max_running, max_drafts, alloc, tp=tp, runner=runner)
        self.n = int(head.num_layers)  # type: ignore[attr-defined]
        self.pools = [(self.k, self.v)]
        for j in range(1, self.n):  # one pool per layer; PD: one more transfer layer each
            shape, dtype = tuple(self.k.shape), self.k.dtype
            if alloc is None:
                k, v = torch.zeros_like(self.k), torch.zeros_like(self.v)
            else:
                k = alloc(f"draft{j}_k", shape, dtype, False)
                v = alloc(f"draft{j}_v", shape, dtype, False)
            self.pools.append((k, v))

    @property
    def pool_bytes(self) -> int:
        return self.n * super().pool_bytes

    def _layer(self, j: int, ids: list[int], pos: list[int], out: list[int],
               seqs: list[SeqSpan], hidden: torch.Tensor) -> torch.Tensor:
        return self._forward(ids, pos, out, seqs, hidden, self.pools[j], layer=j)

    # ---- after the target's forward ------------------------------------------------------------
    def observe(self, items: list[tuple[Req, int]], results: list[StepResult]) -> None:
        op = observe_pass(items, results, self.device)
        if op is None:
            return
        try:
            g = self._layer(0, op.ids, op.pos, op.out, op.seqs, op.hidden)
            last = [p.start + len(p.nxt) - 1 for p in op.pairs]
            tokens = self.agree.argmax(self._logits, g[last])
            states = self._deeper(op.pairs, g)
        except Exception as e:  # the drafts are lost, the step's tokens are not
            self.observe_failed(op, e)
            return
        for p, row, tok, (done, feed) in zip(op.pairs, last, tokens, states):
            sp = p.req.spec
            if sp is None:
                sp = p.req.spec = ReqSpec(cap=self.max_drafts)
            sp.draft = MTPStart(p.at, int(tok), g[row].clone(), done, feed)

    def _deeper(self, plan: list[Pairs],
                g: torch.Tensor) -> list[tuple[list[int], list[torch.Tensor]]]:
        """Layers 1..N-1 over the positions they can now compute for real; every request's
        (done, feed) after it."""
        states, src_out, reach = [], [], []  # per request: state, layer j-1's new outputs, end
        empty = g.new_empty((0, g.shape[1]))
        for p in plan:
            r, row, a, nxt = p.req, p.start, p.a, p.nxt
            st = r.spec.draft if r.spec is not None else None
            if isinstance(st, ChainStart) and st.at == a:
                states.append(_layers_of(st, self.n))
            else:  # a first observe: every layer starts where the target does
                states.append(([a] * self.n, [empty] * self.n))
            src_out.append(g[row : row + len(nxt)])
            reach.append(a + len(nxt))
        for j in range(1, self.n):
            ids: list[int] = []
            pos: list[int] = []
            out: list[int] = []
            seqs: list[SeqSpan] = []
            hidden: list[torch.Tensor] = []
            spans: list[tuple[int, int, torch.Tensor]] = []  # first row, count, layer input
            for pr, (done, feed), new, end in zip(plan, states, src_out, reach):
                r, a, nxt, ctx = pr.req, pr.a, pr.nxt, pr.ctx
                src = torch.cat([feed[j].to(g.dtype), new]) if len(feed[j]) else new
                lo, hi = done[j], min(end, a + len(nxt) - j)
                c = max(0, hi - lo)
                spans.append((len(ids), c, src))
                if c == 0:
                    continue
                seqs.append(SeqSpan(len(ids), c, ctx[:hi].to(self.device)))
                for p in range(lo, hi):
                    q = p + 1 + j
                    ids.append(r.token_at(q) if q <= a else nxt[q - a - 1])
                pos.extend(range(lo, hi))
                out.extend(ctx[lo:hi].tolist())
                hidden.append(src[:c])
            h = self._layer(j, ids, pos, out, seqs, torch.cat(hidden)) if ids else empty
            for i, ((first, c, src), (done, feed)) in enumerate(zip(spans, states)):
                src_out[i] = h[first : first + c].to(g.dtype)
                feed[j] = src[c:]
                done[j] += c
                reach[i] = done[j]
        for p, (done, _) in zip(plan, states):
            done[0] = p.at
        return states

    # ---- the chain ---------------------------------------------------------------------------------
    def propose(self, reqs: list[Req], wants: list[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in reqs]
        live: list[tuple[int, Req, ChainStart, torch.Tensor, list[int], list[torch.Tensor]]] = []
        for i, r in enumerate(reqs):
            st = r.spec.draft if r.spec is not None else None
            if not isinstance(st, ChainStart) or st.at != r.num_computed \
                    or r.seq_len != st.at + 1 or len(live) >= self.rows:
                continue
            drafts[i] = [st.token]
            ctx = r.ctx_slots
            if ctx is None or len(ctx) != st.at:
                ctx = self.blocks.slots(r.pages, 0, st.at)
            live.append((i, r, st, ctx, *_layers_of(st, self.n)))
        steps = max((wants[i] for i, *_ in live), default=0)
        if steps <= 1:
            return drafts
        try:
            self._chain(live, wants, drafts, steps)
        except Exception as e:  # this step drafts nothing; decoding goes on
            dropped = isinstance(e, DraftsDropped)  # another TP rank's pass raised
            if not dropped:
                log.exception("%s draft chain failed (%d requests)", self.head.name, len(live))
            self.agree.failed(None if dropped else len(live))
            self.failures += 1
            return [[] for _ in reqs]
        return drafts

    def _chain(self, live, wants: list[int], drafts: list[list[int]], steps: int) -> None:
        top = self.n - 1
        prev: dict[int, torch.Tensor] = {}  # live index -> its last pass's outputs
        for j in range(1, steps):  # step j gives d_{j+1}
            layer = min(j, top)
            ids, pos, out, seqs, hidden, rows = [], [], [], [], [], []
            for b, (i, r, st, ctx, done, feed) in enumerate(live):
                if wants[i] <= j or (j > 1 and b not in prev):
                    continue
                lo, slot0 = done[layer], self.base + b * self.chain
                if j <= top:  # layer j over [done[j], at): its lag, d_1..d_j its last tokens
                    below = [prev[b]] if j > 1 else []
                    src = torch.cat([feed[j].to(st.hidden.dtype), *below])
                    start, c = lo, st.at - lo
                else:  # the last layer one position further, fed its own previous output
                    src, start, c = prev[b][-1:], st.at - 1 + j - top, 1
                if c <= 0 or len(src) != c or start + c - lo > self.chain:
                    prev.pop(b, None)
                    continue
                scratch = torch.arange(slot0, slot0 + start + c - lo, dtype=torch.long)
                seqs.append(SeqSpan(len(ids), c, torch.cat([ctx[:lo], scratch]).to(
                    self.device)))
                for p in range(start, start + c):
                    q = p + 1 + layer
                    ids.append(r.token_at(q) if q <= st.at else drafts[i][q - st.at - 1])
                pos.extend(range(start, start + c))
                out.extend(scratch[start - lo :].tolist())
                hidden.append(src)
                rows.append((b, len(ids) - c, c))
            prev = {}
            if not rows:
                return
            h = self._layer(layer, ids, pos, out, seqs, torch.cat(hidden))
            toks = self.agree.argmax(self._logits, h[[f + c - 1 for _, f, c in rows]])
            for (b, f, c), t in zip(rows, toks):
                prev[b] = h[f : f + c].to(live[b][2].hidden.dtype)
                drafts[live[b][0]].append(int(t))
