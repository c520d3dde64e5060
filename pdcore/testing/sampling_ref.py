"""The per-row sampler pdserve had before sampling was batched (#47 item 1), kept as the
reference its replacement is checked against (tests/engine/test_sampler_batch.py) and timed
beside (bench/sampler_ab.py): one row at a time, a full sort for top-p, torch.multinomial."""

from __future__ import annotations

import torch

from pdcore.messages.io import SamplingParams


def reference_probs(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature, top-k, min-p, top-p on one row of logits, as the per-row sampler did."""
    row = row / p.temperature
    if 0 < p.top_k < row.numel():
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, -1)
    if p.min_p > 0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    if p.top_p < 1.0:
        sp, si = torch.sort(probs, descending=True)
        sp = sp.masked_fill(torch.cumsum(sp, -1) - sp > p.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, si, sp)
    return probs


def reference_sample(logits: torch.Tensor, params: list[SamplingParams],
                     generators: list[torch.Generator | None]) -> list[int]:
    """One token per row, row by row (a clone, the filters, one multinomial draw each)."""
    out = []
    for i, p in enumerate(params):
        row = logits[i].clone()
        if p.greedy:
            out.append(int(torch.argmax(row)))
        else:
            out.append(int(torch.multinomial(reference_probs(row, p), 1,
                                             generator=generators[i])))
    return out
