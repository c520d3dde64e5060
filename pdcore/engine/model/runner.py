"""Where the model runs: one packed forward pass over the KV pool, nothing about requests.

`ModelRunner.forward` takes a `ForwardBatch` (input ids, positions, pool slots, per-sequence
spans, the rows whose logits are wanted), runs the model (which writes K/V into the pool) and
returns the wanted rows' logits (rank 0 alone computes them under TP) and, when the step asked
for them, the captured hidden states (an EAGLE drafter's input). Packing requests into a batch,
sampling, verify and sharing the results over the TP group happen above it, in the step
(`engine/sched/batch_run.py`): this package imports nothing of `engine/sched`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from pdcore.engine.kv.blocks import BlockManager
from pdcore.engine.kv.cache import KVCache
from pdcore.engine.kv.giveback import give_back
from pdcore.engine.model.batch import ForwardBatch
from pdcore.engine.model.layers import TPInfo

log = logging.getLogger(__name__)


@dataclass
class ForwardOut:
    """What one forward pass gives: the wanted rows' logits (None on TP ranks > 0) and, with
    `capture_hidden` / `capture_layers`, every row's hidden states ([rows, hidden] or EAGLE3's
    [rows, 3 * hidden]; None otherwise)."""

    logits: torch.Tensor | None
    hidden: torch.Tensor | None


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv: KVCache, blocks: BlockManager,
                 tp: TPInfo | None = None) -> None:
        self.model, self.kv, self.blocks = model, kv, blocks
        self.tp = tp or TPInfo()
        self.device = next(model.parameters()).device
        self.capture_hidden = False  # hand each row its hidden states (an EAGLE drafter's)
        # EAGLE3: hand each row instead the residual streams entering these target layers,
        # concatenated ([n, len * hidden]; CausalLM.forward, engine/model/eagle3.py)
        self.capture_layers: tuple[int, ...] | None = None
        self.given_back = 0  # bytes of free KV pages advised away at idle, in all
        self.give_back_pages = True  # engine/build.py: False on a PD server (giveback.allowed)

    def release_caches(self, give_back: bool = True) -> None:
        """Going idle: drop what only a running batch uses (the decode K/V view) and, with
        `give_back`, hand the free KV pages back now (the scheduler process waits for a
        minimum idle time instead: `give_back_free`)."""
        view = getattr(self.model, "decode_kv", None)
        if view is not None:
            view.release()
        if give_back:
            self.give_back_free(0.0)

    def give_back_free(self, idle_s: float) -> int:
        """Hand the free, written KV pages back to the kernel (engine/kv/giveback.py), the
        engine having been idle `idle_s` seconds; returns the bytes (0 on a PD server)."""
        if self.blocks is None or not self.give_back_pages:
            return 0
        given = give_back(self.kv, self.blocks.take_free_written())
        self.given_back += given
        if given:
            log.debug("rank %d gave %d bytes of free KV pages back to the kernel after %.3f s "
                      "idle", self.tp.rank, given, idle_s)
        return given

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> ForwardOut:
        """One forward pass; exceptions propagate (the caller fails the step's requests)."""
        if self.capture_layers:
            batch.capture_layers = self.capture_layers
        elif self.capture_hidden:
            batch.capture_hidden = True
        logits = self.model(batch, self.kv.layers, logits=self.tp.rank == 0)
        return ForwardOut(logits if self.tp.rank == 0 else None, batch.hidden)

    @torch.inference_mode()
    def forward_draft(self, head: torch.nn.Module, batch: ForwardBatch, hidden: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, **kw: int) -> torch.Tensor:
        """One pass of a draft head (EAGLE, EAGLE3, NEXTN, a layer of a multi-layer MTP head,
        `kw`: its `layer`) over its own K/V pool: the outputs [T, hidden] of the pairs
        (hidden[i], batch.input_ids[i]), their K/V written at batch.out_slots. The drafter
        (engine/sched/eagle.py) decides what to feed; exceptions propagate to it."""
        return head(batch, hidden, k_cache, v_cache, **kw)

    def draft_logits(self, head: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """A draft head's logits [R, vocab] over its outputs `hidden` [R, hidden] (its own
        lm_head or the target's, as the head was loaded): the drafter takes their argmax."""
        return head.logits(hidden)
