"""Runs one scheduled batch: pack -> forward (engine/model/runner.py) -> sample.

1. pack: for each (request, n) its next `n` positions (input ids, positions, pool slots) into
   one `ForwardBatch`, with the rows whose logits are wanted (each request's last row when it
   completes its sequence, every row of a verify, prompt-logprob rows);
2. forward: `ModelRunner.forward`, which knows no request, returns those rows' logits;
3. sample the requests that completed their sequence, verify the drafts of those that carried
   some, compute prompt logprobs; all on rank 0, whose results are then shared with every TP
   rank so each rank's scheduler advances identically.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from pdcore.constrained.backend import GrammarBackend
from pdcore.messages.io import LogprobEntry
from pdcore.engine.kv.cache import KVCache
from pdcore.engine.model.batch import ForwardBatch, SeqSpan
from pdcore.engine.model.layers import TPInfo
from pdcore.engine.model.runner import ModelRunner
from pdcore.engine.sched.request import Req
from pdcore.engine.sched.sampler import RowError, logprob_entry, row_error, sample
from pdcore.engine.sched.speculative import verify

log = logging.getLogger(__name__)

# per item: (first prompt-logprob row, their count, first prompt position, sampling row or None)
Plan = list[tuple[int, int, int, int | None]]


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


def _prompt_rows(r: Req, a: int, n: int) -> tuple[int, int]:
    """Positions p in [lo, hi) of this chunk whose logits give the logprob of token p+1."""
    if not r.wants_prompt_logprobs:
        return 0, 0
    lo = max(a, r.logprob_start_len - 1, 0)
    hi = min(a + n, len(r.prompt) - 1)
    return lo, max(lo, hi)


def _verify_item(item: tuple[Req, int]) -> bool:
    r, n = item
    return n > r.remaining and bool(r.drafts)


class BatchRunner:
    """The scheduler's way to the model: packs requests, forwards them through the one
    `ModelRunner`, samples (with the grammar backend) and shares the results over TP."""

    def __init__(self, model_runner: ModelRunner, grammar: GrammarBackend | None = None) -> None:
        self.model_runner = model_runner
        self.grammar = grammar  # structured output (build_engine sets it)
        # sampled batches by the path they took (sampler.sample; /metrics sampler_batches_*)
        self.sampler_paths = {"greedy": 0, "native": 0, "torch": 0}

    # what the scheduler's neighbours read of the model side
    @property
    def model(self) -> torch.nn.Module:
        return self.model_runner.model

    @model.setter
    def model(self, model: torch.nn.Module) -> None:  # tests swap in a failing model
        self.model_runner.model = model

    @property
    def kv(self) -> KVCache:
        return self.model_runner.kv

    @property
    def tp(self) -> TPInfo:
        return self.model_runner.tp

    def release_caches(self, give_back: bool = True) -> None:
        self.model_runner.release_caches(give_back)

    def pack(self, items: list[tuple[Req, int]]) -> tuple[ForwardBatch, Plan]:
        ids: list[int] = []
        pos, slots, seqs, rows = [], [], [], []
        plan: Plan = []
        off = 0
        blocks, device = self.model_runner.blocks, self.model_runner.device
        # a step that verifies drafts attends all its decodes in the verify group: one SDPA
        # per layer, and the decode K/V view is left alone instead of refilled for a subset
        verifying = any(_verify_item(it) for it in items)
        for r, n in items:
            a = r.num_computed
            drafts = r.drafts if n > r.remaining else []  # a verify: [current, d1..dk]
            ids.extend(r.token_at(p) for p in range(a, a + n - len(drafts)))
            ids.extend(drafts)
            pos.append(torch.arange(a, a + n))
            new_slots = blocks.slots(r.pages, a, a + n)
            slots.append(new_slots)
            if a == 0:
                ctx = new_slots
            elif r.ctx_slots is not None and len(r.ctx_slots) == a:
                ctx = torch.cat([r.ctx_slots, new_slots])
            else:  # K/V placed by someone else (a KV transfer): rebuild the table
                ctx = blocks.slots(r.pages, 0, a + n)
            r.ctx_slots = ctx
            verify_seq = bool(drafts) or verifying and n == 1 and a + 1 == r.seq_len
            seqs.append(SeqSpan(off, n, ctx.to(device), key=r.rid, verify=verify_seq))
            lo, hi = _prompt_rows(r, a, n)
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
            input_ids=torch.tensor(ids, dtype=torch.long, device=device),
            positions=torch.cat(pos).to(device),
            out_slots=torch.cat(slots).to(device),
            seqs=seqs,
            logit_rows=torch.tensor(rows, dtype=torch.long, device=device),
        )
        return batch, plan

    @torch.inference_mode()
    def run(self, items: list[tuple[Req, int]]) -> list[StepResult]:
        batch, plan = self.pack(items)
        results = [StepResult(r, n) for r, n in items]
        tp = self.tp
        leader = tp.rank == 0
        failure: RowError | None = None
        try:
            out = self.model_runner.forward(batch)
            if leader:
                assert out.logits is not None
                self._sample(items, plan, out.logits.cpu(), results)
            if out.hidden is not None:
                for res, s in zip(results, batch.seqs):
                    res.hidden = out.hidden[s.q_start : s.q_start + s.q_len]
        except Exception as e:
            # the whole batch fails (no bisection): a forward error is rarely one request's,
            # and re-running sub-batches would write K/V twice and cost more forward passes
            log.exception("forward pass of %d requests failed", len(items))
            failure = (f"forward pass failed: {type(e).__name__}: {e}", 500)
        if tp.size > 1:
            failure = self._share(results, failure)
        if failure is not None:
            for res in results:
                res.token, res.logprob, res.prompt_logprobs, res.error = None, None, None, failure
                res.spec_tokens = res.spec_logprobs = res.hidden = None
        return results

    def _share(self, results: list[StepResult], failure: RowError | None) -> RowError | None:
        """Rank 0's sampled results to every TP rank; reached even after a failure on rank 0,
        so the other ranks never wait for it."""
        tp = self.tp
        leader = tp.rank == 0
        shared = tp.broadcast_object(
            (failure, [(res.token, res.logprob, res.error, res.spec_tokens, res.spec_logprobs)
                       for res in results])
            if leader else None)
        if leader:
            return failure
        if failure is not None and shared[0] is None:
            raise RankDivergedError(f"TP rank {tp.rank}: {failure[0]}")
        for res, (token, lp, err, spec, spec_lp) in zip(results, shared[1]):
            res.token, res.logprob, res.error = token, lp, err
            res.spec_tokens, res.spec_logprobs = spec, spec_lp
        return shared[0]

    def _sample(self, items: list[tuple[Req, int]], plan: Plan, logits: torch.Tensor,
                results: list[StepResult]) -> None:
        samp = [(i, plan[i][3]) for i in range(len(items))
                if plan[i][3] is not None and not _verify_item(items[i])]
        for i, (r, n) in enumerate(items):
            if _verify_item(items[i]):
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
                                     self.grammar, self.sampler_paths)
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
