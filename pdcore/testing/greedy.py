"""Greedy-equivalence checks against transformers `generate`, shared by engine, PD and plugin
end-to-end tests.

The one allowed divergence: at a step where the reference's top two logprobs are within
`tie_tol` of each other (a near tie), the sequences may part from there on; logprobs are still
checked up to that step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Reference:
    tokens: list[int]
    logprobs: list[float]  # logprob of each chosen token
    gaps: list[float]  # top1 - top2 logprob at each step


def hf_greedy(model, input_ids: list[int], max_new_tokens: int) -> Reference:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([input_ids]), max_new_tokens=max_new_tokens, do_sample=False,
            output_logits=True, return_dict_in_generate=True, pad_token_id=0,
        )
    tokens = out.sequences[0, len(input_ids):].tolist()
    lps, gaps = [], []
    for logits, t in zip(out.logits, tokens):
        lp = torch.log_softmax(logits[0].float(), -1)
        top = torch.topk(lp, 2).values
        lps.append(float(lp[t]))
        gaps.append(float(top[0] - top[1]))
    return Reference(tokens, lps, gaps)


def check_greedy(ours: list[int], ref: Reference, our_logprobs: list[float] | None = None,
                 logprob_tol: float = 1e-4, tie_tol: float = 1e-4) -> str:
    """Raises AssertionError on a real mismatch; returns "identical" or "near-tie at step i"."""
    n = min(len(ours), len(ref.tokens))
    for i in range(n):
        if our_logprobs is not None and i < len(our_logprobs) and ours[i] == ref.tokens[i]:
            d = abs(our_logprobs[i] - ref.logprobs[i])
            assert d <= logprob_tol, f"step {i}: logprob differs by {d:.2e} (> {logprob_tol})"
        if ours[i] != ref.tokens[i]:
            if ref.gaps[i] <= tie_tol:
                return f"near-tie at step {i}"
            raise AssertionError(
                f"greedy outputs part at step {i} (ours {ours[i]}, reference {ref.tokens[i]}, "
                f"reference top-2 gap {ref.gaps[i]:.2e}): ours={ours} ref={ref.tokens}"
            )
    assert len(ours) == len(ref.tokens), (
        f"lengths differ: ours {len(ours)}, reference {len(ref.tokens)}")
    return "identical"
