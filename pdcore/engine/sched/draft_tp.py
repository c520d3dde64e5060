"""A draft head's passes under tensor parallelism (EAGLE, NEXTN with `--tp-size N`).

The head's decoder layer is sharded as the target's layers are (engine/model/eagle.py,
nextn.py: query and KV heads split by the same rule, MoE experts as the target's, o_proj and
down all-reduced), its input projection, norms, the embedding and lm_head whole on every rank.
So every TP rank runs every head pass (`HeadDrafter.observe` after each target forward,
`propose`'s chain steps), in lockstep: the batches are built from state every rank holds alike
(the requests' tokens, pages, the tokens rank 0 broadcast after the target's forward, the
hidden states, which come out of the target's all-reduce). Each rank's share of the head's K/V
is its share of the target's heads, so in PD mode the draft layer travels exactly like a target
layer, same TP or not (transfer planners, staging).

What must agree bit for bit are the draft tokens: they become the next pass's input and the
verify's, and they decide pages. Rank 0 alone scores the head's outputs (its lm_head GEMM;
other ranks skip it) and its argmax reaches every rank in one all-reduce of n + 1 integers per
pass over the TP group, whose last one counts the ranks whose pass raised: then every rank
drops the step's drafts alike (decoding goes on, as with one rank).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from pdcore.engine.model.layers import TPInfo

log = logging.getLogger(__name__)


class DraftsDropped(Exception):
    """Another TP rank's head pass raised: every rank drops this step's drafts."""


class TokenAgreement:
    """Draft tokens of a head pass, the same on every TP rank (see the module docstring)."""

    def __init__(self, tp: TPInfo | None, device: torch.device) -> None:
        self.tp = tp or TPInfo()
        self.device = device

    @property
    def leader(self) -> bool:
        return self.tp.rank == 0

    def argmax(self, logits: Callable[[torch.Tensor], torch.Tensor],
               h: torch.Tensor) -> list[int]:
        """The head's draft tokens for its outputs `h` ([R, hidden]): rank 0's argmax, agreed
        by every rank (DraftsDropped where a rank's pass raised: `failed` was called there)."""
        mine = logits(h).argmax(-1).tolist() if self.leader else []
        if self.tp.size == 1:
            return mine
        got = self._agree(mine, h.shape[0])
        if got is None:
            raise DraftsDropped
        return got

    def common(self, tokens: list[int]) -> list[int]:
        """Per request, its value where every TP rank holds the same one, else -1 (-1: none):
        which chain starts every rank can run (one all-reduce over the CPU group; no cost with
        one rank)."""
        if self.tp.size == 1 or not tokens:
            return tokens
        n = len(tokens)
        low = self.tp.all_min(list(tokens) + [-t for t in tokens])
        out = [low[i] if low[i] == -low[n + i] else -1 for i in range(n)]
        if out != tokens:
            log.warning("%d chain start(s) not held alike on every TP rank: dropped",
                        sum(a != b for a, b in zip(out, tokens)))
        return out

    def failed(self, rows: int | None) -> None:
        """This rank's pass of `rows` outputs raised before `argmax` agreed: tell the others
        (they are waiting in `argmax`). None: the failure was the agreement itself."""
        if self.tp.size > 1 and rows is not None:
            self._agree(None, rows)

    def _agree(self, tokens: list[int] | None, n: int) -> list[int] | None:
        t = torch.zeros(n + 1, dtype=torch.long, device=self.device)
        if tokens is None:
            t[n] = 1
        elif self.leader:
            t[:n] = torch.tensor(tokens, dtype=torch.long)
        self.tp.all_reduce(t)
        if int(t[n]):
            log.warning("a draft head pass raised on %d TP rank(s): this step drafts nothing",
                        int(t[n]))
            return None
        return [int(x) for x in t[:n].tolist()]
