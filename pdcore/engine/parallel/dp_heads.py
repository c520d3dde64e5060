"""A draft head with MoE layers under `--enable-dp-attention` (NEXTN: the MTP layer's MLP is a
DeepSeek-V3 MoE layer): its MoE collectives span every DP rank, as the target's do
(pdcore.engine.parallel.dp_attention), so every DP rank must run the same head passes, in the
same place, each scheduler step, whatever its own batch needs:

- before the target's forward, exactly `bound` head passes (the chain's at most k - 1 passes,
  engine/sched/eagle.py `propose`, padded with idle passes: zero rows through the head's MoE
  layers, which only join the collectives);
- after it, exactly one (`observe`'s, or an idle one);
- a step without a target forward (an idle step, a PD poll) runs the idle forward between the
  two (DPSync.idle_forward), so every DP rank issues bound + 1 head passes and one target
  forward per step, in that order. DPSync.end counts them all.

Every head pass gathers its own row counts (the head's rows are not the target forward's).
"""

from __future__ import annotations

import torch

from pdcore.engine.parallel.dp_gather import DPAttnTPInfo


class HeadPads:
    """The head's MoE collectives of one DP rank, padded to bound + 1 passes per step."""

    def __init__(self, dp: DPAttnTPInfo, head: torch.nn.Module, bound: int) -> None:
        from pdcore.engine.model.moe import MoE

        self.dp, self.bound = dp, bound
        self.moes = [m for m in head.modules() if isinstance(m, MoE) and m.dp is not None]
        self._mark = 0
        self.forwarded = False  # this step ran the target's forward
        self.idle_passes = 0

    @property
    def per_step(self) -> int:
        """The head's MoE gathers in every step."""
        return (self.bound + 1) * len(self.moes)

    def fresh(self) -> None:
        """A head pass starts or ends: the next MoE layer gathers its own row counts."""
        self.dp.counts[0] = None

    def begin(self) -> None:
        """A step starts: its pre-forward passes count from here."""
        self._mark = self.dp.forwards[0]
        self.forwarded = False

    def _pad(self, want: int) -> None:
        ran = self.dp.forwards[0] - self._mark
        if ran > want * len(self.moes):
            raise RuntimeError(f"DP attention: the draft head ran {ran} MoE layers in a phase "
                               f"of {want} passes; the DP ranks' collectives no longer match")
        for _ in range((want * len(self.moes) - ran) // len(self.moes)):
            self.idle()

    @torch.inference_mode()
    def idle(self) -> None:
        """One idle head pass: zero rows through the head's MoE layers."""
        self.idle_passes += 1
        self.fresh()
        for m in self.moes:
            m(torch.empty(0, m.gate.shape[1], dtype=m.w13.dtype, device=m.w13.device))
        self.fresh()

    def before_forward(self) -> None:
        """Right before the target's forward: the chain's passes padded to `bound`."""
        self._pad(self.bound)
        self.forwarded = True
        self.fresh()

    def after_forward_begin(self) -> None:
        """After the target's forward, before `observe`'s pass."""
        self._mark = self.dp.forwards[0]

    def after_forward_end(self) -> None:
        self._pad(1)
        self.fresh()


def head_pads(tp: object, head: torch.nn.Module, bound: int) -> HeadPads | None:
    """The pads of a head with MoE layers under DP attention; None for any other (a dense head
    runs in its DP rank's attention group alone)."""
    if not isinstance(tp, DPAttnTPInfo):
        return None
    pads = HeadPads(tp, head, bound)
    return pads if pads.moes else None
