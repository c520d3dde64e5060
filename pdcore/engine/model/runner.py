"""Turns scheduled (request, token count) pairs into one packed forward pass, then samples.

1. pack: for each request its next `n` positions (input ids, positions, pool slots);
2. forward: the model writes K/V into the pool and returns logits for the wanted rows only
   (each request's last row when it completes its sequence, plus prompt-logprob rows);
3. sample the requests that completed their sequence; compute prompt logprobs.

With TP, every rank runs the layers on its shards; rank 0 alone computes logits and samples,
then broadcasts the sampled tokens (and their logprobs, which P writes into aux rows) so every
rank's scheduler advances identically.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from pdcore.engine.io_struct import LogprobEntry
from pdcore.engine.kv.blocks import BlockManager
from pdcore.engine.kv.cache import KVCache
from pdcore.engine.model.batch import ForwardBatch, SeqSpan
from pdcore.engine.model.layers import TPInfo
from pdcore.engine.sched.grammar import GrammarBackend
from pdcore.engine.sched.request import Req
from pdcore.engine.sched.sampler import RowError, logprob_entry, row_error, sample
from pdcore.engine.sched.speculative import verify

log = logging.getLogger(__name__)


@dataclass
class StepResult:
    req: Req
    n: int
    token: int | None = None  # sampled when the request reached the end of its sequence
    logprob: LogprobEntry | None = None
    prompt_logprobs: list[LogprobEntry] | None = None
    error: RowError | None = None  # (message, HTTP status): this request failed in this step
    # speculative decoding: the tokens a verify pass gave (accepted drafts + the target's own)
    # and their logprob entries; `token` stays None then
    spec_tokens: list[int] | None = None
    spec_logprobs: list[LogprobEntry] | None = None
    # with ModelRunner.capture_hidden: the target's final-norm hidden states of this item's n
    # positions ([n, hidden]; an EAGLE drafter reads them; with capture_layers, EAGLE3's
    # [n, 3 * hidden]), None after a failed forward
    hidden: torch.Tensor | None = None


class RankDivergedError(RuntimeError):
    """This TP rank failed a step that rank 0 completed: the shards disagree, so the rank must
    leave the group (which fails the whole server) rather than serve a wrong schedule."""


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv: KVCache, blocks: BlockManager,
                 tp: TPInfo | None = None) -> None:
        self.model, self.kv, self.blocks = model, kv, blocks
        self.tp = tp or TPInfo()
        self.grammar: GrammarBackend | None = None  # structured output (build_engine sets it)
        self.device = next(model.parameters()).device
        self.capture_hidden = False  # hand each item its hidden states (an EAGLE drafter's)
        # EAGLE3: hand each item instead the residual streams entering these target layers,
        # concatenated ([n, len * hidden]; CausalLM.forward, engine/model/eagle3.py)
        self.capture_layers: tuple[int, ...] | None = None

    def release_caches(self) -> None:
        """Going idle: drop what only a running batch uses (the decode K/V view)."""
        view = getattr(self.model, "decode_kv", None)
        if view is not None:
            view.release()

    def _prompt_rows(self, r: Req, a: int, n: int) -> tuple[int, int]:
        """Positions p in [lo, hi) of this chunk whose logits give the logprob of token p+1."""
        if not r.wants_prompt_logprobs:
            return 0, 0
        lo = max(a, r.logprob_start_len - 1, 0)
        hi = min(a + n, len(r.prompt) - 1)
        return lo, max(lo, hi)

    @torch.inference_mode()
    def run(self, items: list[tuple[Req, int]]) -> list[StepResult]:
        ids, pos, slots, seqs, rows = [], [], [], [], []
        plan = []  # per item: (first prompt row index, count, sampling row index or None)
        off = 0
        # a step that verifies drafts attends all its decodes in the verify group: one SDPA
        # per layer, and the decode K/V view is left alone instead of refilled for a subset
        verifying = any(self._verify_item(it) for it in items)
        for r, n in items:
            a = r.num_computed
            drafts = r.drafts if n > r.remaining else []  # a verify: [current, d1..dk]
            ids.extend(r.token_at(p) for p in range(a, a + n - len(drafts)))
            ids.extend(drafts)
            pos.append(torch.arange(a, a + n))
            new_slots = self.blocks.slots(r.pages, a, a + n)
            slots.append(new_slots)
            if a == 0:
                ctx = new_slots
            elif r.ctx_slots is not None and len(r.ctx_slots) == a:
                ctx = torch.cat([r.ctx_slots, new_slots])
            else:  # K/V placed by someone else (a KV transfer): rebuild the table
                ctx = self.blocks.slots(r.pages, 0, a + n)
            r.ctx_slots = ctx
            verify = bool(drafts) or verifying and n == 1 and a + 1 == r.seq_len
            seqs.append(SeqSpan(off, n, ctx.to(self.device), key=r.rid, verify=verify))
            lo, hi = self._prompt_rows(r, a, n)
            p_first = len(rows)
            rows.extend(range(off + lo - a, off + hi - a))
            s_row = None
            if drafts:  # every row: row j scores draft j+1 (and the last one the bonus token)
                s_row = len(rows)
                rows.extend(range(off, off + n))
            elif a + n == r.seq_len:
                s_row = len(rows)
                rows.append(off + n - 1)
            plan.append((p_first, hi - lo, lo, s_row))
            off += n
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=self.device),
            positions=torch.cat(pos).to(self.device),
            out_slots=torch.cat(slots).to(self.device),
            seqs=seqs,
            logit_rows=torch.tensor(rows, dtype=torch.long, device=self.device),
        )
        if self.capture_layers:
            batch.extra["capture_layers"] = self.capture_layers
        elif self.capture_hidden:
            batch.extra["capture_hidden"] = True
        results = [StepResult(r, n) for r, n in items]
        leader = self.tp.rank == 0
        failure: RowError | None = None
        try:
            logits = self.model(batch, self.kv.layers, logits=leader)
            if leader:
                self._sample(items, plan, logits.cpu(), results)
            hidden = batch.extra.get("hidden")
            if hidden is not None:
                for res, s in zip(results, seqs):
                    res.hidden = hidden[s.q_start : s.q_start + s.q_len]
        except Exception as e:
            # the whole batch fails (no bisection): a forward error is rarely one request's,
            # and re-running sub-batches would write K/V twice and cost more forward passes
            log.exception("forward pass of %d requests failed", len(items))
            failure = (f"forward pass failed: {type(e).__name__}: {e}", 500)
        if self.tp.size > 1:
            # reached even after a failure on rank 0, so the other ranks never wait for it
            shared = self.tp.broadcast_object(
                (failure, [(res.token, res.logprob, res.error, res.spec_tokens, res.spec_logprobs)
                           for res in results])
                if leader else None)
            if not leader:
                if failure is not None and shared[0] is None:
                    raise RankDivergedError(f"TP rank {self.tp.rank}: {failure[0]}")
                failure = shared[0]
                for res, (token, lp, err, spec, spec_lp) in zip(results, shared[1]):
                    res.token, res.logprob, res.error = token, lp, err
                    res.spec_tokens, res.spec_logprobs = spec, spec_lp
        if failure is not None:
            for res in results:
                res.token, res.logprob, res.prompt_logprobs, res.error = None, None, None, failure
                res.spec_tokens = res.spec_logprobs = res.hidden = None
        return results

    @staticmethod
    def _verify_item(item: tuple[Req, int]) -> bool:
        r, n = item
        return n > r.remaining and bool(r.drafts)

    def _sample(self, items: list[tuple[Req, int]], plan: list[tuple[int, int, int, int | None]],
                logits: torch.Tensor, results: list[StepResult]) -> None:
        samp = [(i, plan[i][3]) for i in range(len(items))
                if plan[i][3] is not None and not self._verify_item(items[i])]
        for i, (r, n) in enumerate(items):
            if self._verify_item(items[i]):
                row = plan[i][3]
                toks, lps, err = verify(logits[row : row + n], r.state, r.drafts,
                                        r.top_logprobs_num if r.return_logprob else None,
                                        self.grammar)
                results[i].error = err
                if err is None:
                    results[i].spec_tokens = toks
                    results[i].spec_logprobs = lps if r.return_logprob else None
        if samp:
            states = [items[i][0].state for i, _ in samp]
            want = [items[i][0].top_logprobs_num if items[i][0].return_logprob else None
                    for i, _ in samp]
            toks, lps, errs = sample(logits[[row for _, row in samp]], states, want,
                                     self.grammar)
            for (i, _), t, lp, err in zip(samp, toks, lps, errs):
                results[i].token, results[i].logprob, results[i].error = t, lp, err
        for i, (p_first, count, lo, _) in enumerate(plan):
            if count and results[i].error is None:
                r = items[i][0]
                try:
                    lp = torch.log_softmax(logits[p_first : p_first + count], -1)
                    results[i].prompt_logprobs = [
                        logprob_entry(lp[j], r.prompt[lo + j + 1], r.top_logprobs_num)
                        for j in range(count)
                    ]
                except Exception as e:  # noqa: BLE001 - isolated to this request
                    results[i].token, results[i].error = None, row_error(e, "prompt logprobs")
