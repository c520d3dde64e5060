"""What every model family shares around its decoder layers: the token embedding, the final
norm and the lm_head (packed for small-batch GEMMs), the logits of the wanted rows, and those
weights from an HF checkpoint. A family supplies its layers, their loop and their weights."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pdcore.engine.model.batch import ForwardBatch
from pdcore.engine.model.layers import RMSNorm, TPInfo, linear, pack_in_place
from pdcore.engine.model.weights import adopt


class CausalLM(nn.Module):
    def __init__(self, cfg: Any, tp: TPInfo | None, arch: str) -> None:
        super().__init__()
        self.cfg, self.tp, self.arch = cfg, tp or TPInfo(), arch
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size),
                                    requires_grad=False)
        self.lm_head_packed: torch.Tensor | None = None

    def pack_lm_head(self) -> None:
        self.lm_head, self.lm_head_packed = pack_in_place(self.lm_head, prefill=False)

    def logits_of(self, residual: torch.Tensor, batch: ForwardBatch,
                  logits: bool) -> torch.Tensor | None:
        """Float32 logits [R, vocab] of batch.logit_rows from the last layer's residual stream;
        None when `logits` is False (TP ranks other than 0 leave sampling to rank 0). With
        batch.extra["capture_hidden"] set, every row's final-norm output (what the lm_head
        reads: the hidden state an EAGLE draft head takes) goes to batch.extra["hidden"]."""
        if batch.extra.get("capture_hidden"):
            batch.extra["hidden"] = self.norm(residual)
        if not logits:
            return None
        h = self.norm(residual[batch.logit_rows])
        return linear(h, self.lm_head, None, self.lm_head_packed).float()

    def load_outer(self, sd: dict[str, torch.Tensor]) -> None:
        """The embedding (its mapped tensor serves as it is: the lookup reads a few rows a
        step), the lm_head (tied to the embedding when the checkpoint has none) and the final
        norm."""
        embed = sd["model.embed_tokens.weight"]
        self.embed_tokens.weight = adopt(self.embed_tokens.weight, embed)
        lm = sd.get("lm_head.weight")
        self.lm_head.copy_(lm if lm is not None else embed)
        self.norm.weight.copy_(sd["model.norm.weight"])
