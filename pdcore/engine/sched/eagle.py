"""Draft-head drafts, chains (`--speculative-eagle-topk 1`): a one-layer draft head that reads
the target's hidden states. Three heads plug in (`DraftHead`): EAGLE (`--speculative-algorithm
EAGLE`, an EAGLE-1 head, engine/model/eagle.py), EAGLE3 (a head over three captured target
layers and a draft vocabulary mapped to target ids, engine/model/eagle3.py) and NEXTN (a
DeepSeek-V3 checkpoint's own MTP layer, engine/model/nextn.py, or a MiMo's first,
engine/model/mimo.py); everything below is the same for all. A head of N >= 2 layers (`--enable-multi-layer-eagle`: a MiMo's own MTP
layers) is driven by the subclass MultiLayerDrafter (engine/sched/mtp_chain.py).

The head's input at position p is the pair (f_p, t_{p+1}): the target's hidden state at p (the
one its lm_head reads there) and the token after p. Its output g_{p+1} stands for f_{p+1}: the
head's logits of g_{p+1} score t_{p+2}, and (g_{p+1}, that token) is the pair at p + 1.

- After every target forward (`observe`, before the scheduler applies the step's tokens), the
  head runs over the pairs of every position the target just computed (prefill chunks,
  decodes, the accepted part of a verify: the tokens after them are then known: the prompt's,
  the sampled token, the verify's tokens), batched over the step's requests. Its K/V go into
  the drafter's one-layer pool at the same slots as the target's K/V of those positions, so
  the draft context lives in the request's own pages: pages shared through the prefix cache
  carry their draft K/V, a preempted, finished or aborted request frees its draft K/V with its
  pages, and rejected drafts' positions are simply written again by the next observe. The
  output at the request's last computed position gives the first draft token and the hidden
  state the chain continues from (kept in req.spec.draft, dropped with the request). In PD
  mode P's chain start (made with the first token, on its last prompt chunk) crosses to D in
  the aux row (disagg/aux.py; SchedulerAPI.chain_start / adopt_chain_start), so D drafts
  from its first decode step on; one that fails D's checks is dropped, and that step runs
  without drafts.
- `propose` (the next step, for the decode batch) extends the chain: k - 1 more passes of one
  token per request, batched, each attending the request's draft context plus the chain so far.
  The chain's K/V are scratch (slots past the pool's pages, reused every step): they stand on
  guessed tokens, and the verify decides which positions become real.

Drafts are the head's argmax (a chain; trees, topk > 1, are not built). Whatever the head
proposes, the verify pass keeps the output exact (greedy identity; sampled: plain decoding's
draw per row, the draft kept when it is that token).
A failed draft pass costs the step its drafts only (logged, counted); decoding goes on.
With TP the head's layer is sharded as the target's and every rank runs every pass; rank 0's
draft tokens and the failures are agreed over the group (engine/sched/draft_tp.py). With
--enable-dp-attention the head runs in its DP rank's attention group; a head with MoE layers
(NEXTN) joins collectives over every DP rank, so each DP rank pads its passes to the same count
per step (`dp_pads`, engine/parallel/dp_heads.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from pdcore.engine.model.batch import ForwardBatch, SeqSpan
from pdcore.engine.sched.draft_tp import DraftsDropped, TokenAgreement
from pdcore.engine.sched.drafter import Drafter
from pdcore.engine.sched.speculative import ReqSpec

if TYPE_CHECKING:
    from pdcore.engine.kv.blocks import BlockManager
    from pdcore.engine.model.layers import TPInfo
    from pdcore.engine.model.runner import ModelRunner
    from pdcore.engine.sched.batch_run import StepResult
    from pdcore.engine.sched.request import Req

log = logging.getLogger(__name__)


class DraftHead(Protocol):
    """What a draft head supplies (an nn.Module: its parameters give the device and dtype)."""

    name: str  # the algorithm, in logs

    @property
    def kv_layout(self) -> tuple[int, int, bool]:
        """(heads, head_dim, latent) of its one attention layer's pool; latent: one buffer
        serves as K and V (MLA)."""
        ...

    def __call__(self, batch: ForwardBatch, hidden: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor) -> torch.Tensor:
        """Outputs [T, hidden] of the pairs (hidden[i], batch.input_ids[i]); K/V written at
        batch.out_slots."""
        ...

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Float32 logits [R, vocab] of outputs h [R, hidden]."""
        ...

    def parameters(self): ...


def known_next(r: Req, n: int, res: StepResult) -> list[int]:
    """The tokens after the n positions a target step computed for `r` (from r.num_computed),
    as far as they are known: a verify's accepted drafts + its bonus token, else the prompt's
    next tokens and, where the step reached the sequence's end, the token it sampled."""
    if res.spec_tokens is not None:
        return list(res.spec_tokens)[:n]
    a = r.num_computed
    nxt = [r.token_at(p + 1) for p in range(a, min(a + n, r.seq_len - 1))]
    if a + n == r.seq_len and res.token is not None:
        nxt.append(res.token)
    return nxt[:n]


@dataclass
class ChainStart:
    """Where a request's next chain starts: made by `observe` when the target had computed
    `at` positions (valid while req.num_computed == at)."""

    at: int
    token: int  # the first draft: the head's argmax at position at - 1
    hidden: torch.Tensor  # [hidden]: the head's output there, fed with `token` at `at`


@dataclass
class Pairs:
    """One request's share of an observe pass: the pairs of the positions [a, a + len(nxt))
    the target just computed."""

    req: Req
    start: int  # its first row in the pass
    a: int  # its computed positions before the step
    nxt: list[int]  # the tokens after those positions (known_next)
    ctx: torch.Tensor  # its slot table through a + len(nxt)

    @property
    def at(self) -> int:
        """The computed positions once these pairs are in (ChainStart.at)."""
        return self.a + len(self.nxt)


@dataclass
class ObservePass:
    """The packed input of a head's first layer over a target step's pairs (every head's
    `observe` starts from it: one gathering loop for EAGLE, EAGLE3, NEXTN and multi-layer MTP)."""

    ids: list[int]
    pos: list[int]
    out: list[int]  # the pool slots its K/V go to: the target's slots of the same positions
    seqs: list[SeqSpan]
    hidden: torch.Tensor  # the target's hidden states of every pair's position
    pairs: list[Pairs]


def observe_pass(items: list[tuple[Req, int]], results: list[StepResult],
                 device: torch.device) -> ObservePass | None:
    """The pairs of every position a target step computed whose next token is known; None
    when there are none (failed rows, no captured hidden states, nothing known yet)."""
    ids: list[int] = []
    pos: list[int] = []
    out: list[int] = []
    seqs: list[SeqSpan] = []
    hidden: list[torch.Tensor] = []
    pairs: list[Pairs] = []
    for (r, n), res in zip(items, results):
        if res.error is not None or res.hidden is None or r.ctx_slots is None:
            continue
        a = r.num_computed
        nxt = known_next(r, n, res)
        v = len(nxt)
        if v <= 0:
            continue
        ctx = r.ctx_slots[: a + v]
        seqs.append(SeqSpan(len(ids), v, ctx.to(device)))
        pairs.append(Pairs(r, len(ids), a, nxt[:v], ctx))
        ids.extend(nxt[:v])
        pos.extend(range(a, a + v))
        out.extend(ctx[a:].tolist())
        hidden.append(res.hidden[:v])
    if not pairs:
        return None
    return ObservePass(ids, pos, out, seqs, torch.cat(hidden), pairs)


class HeadDrafter(Drafter):
    needs_hidden = True

    def __init__(self, head: DraftHead, blocks: BlockManager, max_running: int,
                 max_drafts: int, alloc: Callable[..., torch.Tensor] | None = None, *,
                 tp: TPInfo | None = None, runner: ModelRunner | None = None) -> None:
        """`alloc(label, shape, dtype, latent)`: where the K/V pool lives (PD: the KV cache's
        memory, so it travels with the target's pages: KVCache.draft_buffer); zeros by default.
        `tp`: the target's TP group; every rank runs every head pass and rank 0's draft tokens
        reach them all (engine/sched/draft_tp.py). `runner`: the engine's model runner, through
        which every head pass runs (the target's forward runs there too)."""
        self.head, self.blocks, self.runner = head, blocks, runner
        self.max_drafts = max(1, max_drafts)
        p = next(head.parameters())
        self.device, dtype = p.device, p.dtype
        self.agree = TokenAgreement(tp, self.device)
        ps = blocks.page_size
        self.base = blocks.num_pages * ps  # the first scratch slot
        self.chain = max(1, self.max_drafts - 1)  # scratch slots per request
        self.rows = max(1, max_running)  # requests a chain holds scratch for
        pages = blocks.num_pages + -(-(self.rows * self.chain) // ps)
        heads, dim, latent = head.kv_layout
        shape = (pages, ps, heads, dim)
        if alloc is None:
            self.k = torch.zeros(shape, dtype=dtype, device=self.device)
            self.v = self.k if latent else torch.zeros(shape, dtype=dtype, device=self.device)
        else:
            self.k = alloc("draft_k", shape, dtype, latent)
            self.v = self.k if latent else alloc("draft_v", shape, dtype, latent)
        self.passes = 0  # head forward passes (observe and chain steps)
        from pdcore.engine.parallel.dp_heads import head_pads

        # DP attention and a head with MoE layers (NEXTN): bound + 1 passes on every DP rank
        self.dp_pads = head_pads(tp, head, max(0, self.max_drafts - 1))
        self.failures = 0  # draft passes that raised (their step drafted nothing)

    def stats(self) -> dict[str, int]:
        """The head's forward passes and the draft passes that raised (/metrics: counters)."""
        return {"spec_draft_passes_total": self.passes, "spec_draft_failures_total": self.failures}

    @property
    def pool_bytes(self) -> int:
        return (1 if self.v is self.k else 2) * self.k.numel() * self.k.element_size()

    def _forward(self, ids: list[int], pos: list[int], out: list[int], seqs: list[SeqSpan],
                 hidden: torch.Tensor, pool: tuple[torch.Tensor, torch.Tensor],
                 **kw: int) -> torch.Tensor:
        """One head pass through the engine's model runner (ModelRunner.forward_draft): the
        pairs (hidden[i], ids[i]) at positions pos, their K/V written at slots out of `pool`
        (its K and V buffers)."""
        k, v = pool
        if self.runner is None:
            raise RuntimeError(f"the {self.head.name} drafter has no model runner")
        dev = self.device
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=torch.tensor(pos, dtype=torch.long, device=dev),
            out_slots=torch.tensor(out, dtype=torch.long, device=dev), seqs=seqs,
            logit_rows=torch.empty(0, dtype=torch.long, device=dev))
        self.passes += 1
        return self.runner.forward_draft(self.head, batch, hidden.to(dtype=k.dtype), k, v, **kw)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """The head's logits over its outputs `h`, through the model runner."""
        if self.runner is None:
            raise RuntimeError(f"the {self.head.name} drafter has no model runner")
        return self.runner.draft_logits(self.head, h)

    def _run(self, ids: list[int], pos: list[int], out: list[int], seqs: list[SeqSpan],
             hidden: torch.Tensor) -> torch.Tensor:
        pads = self.dp_pads
        if pads is not None:
            pads.fresh()  # a head pass gathers its own row counts (DP attention, MoE head)
        try:
            return self._forward(ids, pos, out, seqs, hidden, (self.k, self.v))
        finally:
            if pads is not None:
                pads.fresh()

    def before_forward(self) -> None:
        """Right before the target's forward (DP attention: the chain's passes padded)."""
        if self.dp_pads is not None:
            self.dp_pads.before_forward()

    # ---- after the target's forward ------------------------------------------------------------
    def observe(self, items: list[tuple[Req, int]], results: list[StepResult]) -> None:
        if self.dp_pads is None:
            self._observe(items, results)
            return
        self.dp_pads.after_forward_begin()
        try:
            self._observe(items, results)
        finally:
            self.dp_pads.after_forward_end()

    def _observe(self, items: list[tuple[Req, int]], results: list[StepResult]) -> None:
        op = observe_pass(items, results, self.device)
        if op is None:
            return
        try:
            g = self._run(op.ids, op.pos, op.out, op.seqs, op.hidden)
            last = torch.tensor([p.start + len(p.nxt) - 1 for p in op.pairs], device=self.device)
            tokens = self.agree.argmax(self._logits, g[last])
        except Exception as e:  # the drafts are lost, the step's tokens are not
            self.observe_failed(op, e)
            return
        for p, row, tok in zip(op.pairs, last.tolist(), tokens):
            sp = p.req.spec
            if sp is None:
                sp = p.req.spec = ReqSpec(cap=self.max_drafts)
            sp.draft = ChainStart(p.at, int(tok), g[row].clone())

    def observe_failed(self, op: ObservePass, e: Exception) -> None:
        """An observe pass raised: logged and counted, its requests' chain starts dropped."""
        dropped = isinstance(e, DraftsDropped)  # another TP rank's pass raised
        if not dropped:
            log.exception("%s draft head failed on the target's step (%d pairs)",
                          self.head.name, len(op.ids))
        self.agree.failed(None if dropped else len(op.pairs))
        self.failures += 1
        for p in op.pairs:
            if p.req.spec is not None:
                p.req.spec.draft = None

    # ---- the chain ---------------------------------------------------------------------------------
    def starts(self, reqs: list[Req]) -> list[ChainStart | None]:
        """Each request's chain start where it starts this step's chain, held alike on every
        TP rank: one that some rank lacks (a PD aux row one rank dropped) is dropped on all,
        since every rank runs the chain's passes (engine/sched/draft_tp.py)."""
        out: list[ChainStart | None] = []
        for r in reqs:
            st = r.spec.draft if r.spec is not None else None
            ok = isinstance(st, ChainStart) and st.at == r.num_computed and r.seq_len == st.at + 1
            out.append(st if ok else None)
        agreed = self.agree.common([st.token if st is not None else -1 for st in out])
        return [st if t >= 0 else None for st, t in zip(out, agreed)]

    def propose(self, reqs: list[Req], wants: list[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in reqs]
        live: list[tuple[int, ChainStart, torch.Tensor]] = []
        for i, (r, st) in enumerate(zip(reqs, self.starts(reqs))):
            if st is None or len(live) >= self.rows:
                continue
            drafts[i] = [st.token]
            ctx = r.ctx_slots
            if ctx is None or len(ctx) != st.at:
                ctx = self.blocks.slots(r.pages, 0, st.at)
            live.append((i, st, ctx))
        steps = max((wants[i] for i, _, _ in live), default=0)
        if steps <= 1:
            return drafts
        g = torch.stack([st.hidden for _, st, _ in live])
        act: list[int] = []
        try:
            for j in range(1, steps):  # the pair (g, d_j) at position at + j - 1 gives d_j+1
                act = [b for b, (i, _, _) in enumerate(live) if wants[i] > j]
                if not act:
                    break
                ids, pos, out, seqs = [], [], [], []
                for q, b in enumerate(act):
                    i, st, ctx = live[b]
                    scratch = [self.base + b * self.chain + c for c in range(j)]
                    seqs.append(SeqSpan(q, 1, torch.cat(
                        [ctx, torch.tensor(scratch, dtype=torch.long)]).to(self.device)))
                    ids.append(drafts[i][-1])
                    pos.append(st.at + j - 1)
                    out.append(scratch[-1])
                h = self._run(ids, pos, out, seqs, g[act])
                toks = self.agree.argmax(self._logits, h)
                g = g.clone()
                g[act] = h.to(g.dtype)
                for b, t in zip(act, toks):
                    drafts[live[b][0]].append(int(t))
        except Exception as e:  # this step drafts nothing; decoding goes on
            dropped = isinstance(e, DraftsDropped)  # another TP rank's pass raised
            if not dropped:
                log.exception("%s draft chain failed (%d requests)", self.head.name, len(live))
            self.agree.failed(None if dropped else len(act))
            self.failures += 1
            return [[] for _ in reqs]
        return drafts
