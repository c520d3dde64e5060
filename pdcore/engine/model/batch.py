"""The batch a forward pass runs: every sequence's new tokens packed into one tensor, with the
groups the attention layers read (one-token decodes, speculative verifies) built once per step.
Shared by every model family and the model runner."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

_UNBUILT: Any = object()  # a step group not built yet (None: built, and the step has none)


@dataclass
class SeqSpan:
    q_start: int  # offset of this sequence's new tokens in the packed batch
    q_len: int
    ctx_slots: torch.Tensor  # long [ctx_len]: pool slots of every position 0..ctx_len-1
    key: object = None  # the request's id: lets the decode K/V view carry over between steps
    verify: bool = False  # a speculative verify: a few new tokens after a long context


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # long [T]
    positions: torch.Tensor  # long [T]
    out_slots: torch.Tensor  # long [T]: where each new token's K/V goes
    seqs: list[SeqSpan]
    logit_rows: torch.Tensor  # long [R]: rows of the pack whose logits are wanted
    # what the step asks of the model besides logits (ModelRunner.forward sets them):
    capture_hidden: bool = False  # every row's final-norm output into `hidden` (EAGLE)
    # EAGLE3: the residual streams entering these layers, concatenated, into `hidden`
    capture_layers: tuple[int, ...] | None = None
    # what the model leaves on the batch during its forward:
    hidden: torch.Tensor | None = None  # the captured rows ([T, hidden] or [T, k * hidden])
    kv_view: Any = None  # the decode K/V view this forward attends through (llama.py)
    native_prefill: int = 0  # prefill chunks whose attention took the native kernel (llama.py)
    _decode: DecodeGroup | None = field(default=_UNBUILT, init=False, repr=False)
    _verify: VerifyGroup | None = field(default=_UNBUILT, init=False, repr=False)

    def decode_group(self) -> DecodeGroup | None:
        """The step's one-token sequences as one padded batch (built once, used by every layer),
        or None when none decodes. A lone decode is a group of one (#48): it takes the decode
        K/V view and the native layer loop as a batch does."""
        if self._decode is _UNBUILT:
            dec = [s for s in self.seqs if s.q_len == 1 and not s.verify]
            group = DecodeGroup.build(dec) if dec else None
            if group is not None and len(dec) == len(self.seqs) == len(self.input_ids):
                group.whole = all(s.q_start == i for i, s in enumerate(dec))
            self._decode = group
        return self._decode

    def verify_group(self) -> VerifyGroup | None:
        """The step's verify sequences as one padded batch (built once, used by every layer)."""
        if self._verify is _UNBUILT:
            seqs = [s for s in self.seqs if s.verify]
            self._verify = VerifyGroup.build(seqs) if seqs else None
        return self._verify


@dataclass
class VerifyGroup:
    """Sequences of a few query tokens after their context (speculative verify), attended in
    one SDPA per layer: queries padded to the longest (qmax), contexts to the widest (width);
    query i of a sequence sees the keys up to its own position."""

    rows: torch.Tensor  # long [B * qmax]: each query's row in the pack (padding repeats)
    real: torch.Tensor  # bool [B * qmax]: not padding
    table: torch.Tensor  # long [B * width]: context slots (padding: slot 0, masked)
    bias: torch.Tensor  # float32 [B, 1, qmax, width]: 0 where visible, -inf elsewhere
    qmax: int
    width: int
    _grouped: dict = field(default_factory=dict)

    def grouped_bias(self, dtype: torch.dtype, group: int) -> torch.Tensor:
        """The bias for `group` query heads per KV head stacked as query rows ([B, 1, group *
        qmax, width], head-major), in `dtype`: built once per step, read by every layer."""
        key = (dtype, group)
        if key not in self._grouped:
            self._grouped[key] = self.bias.to(dtype).repeat(1, 1, group, 1)
        return self._grouped[key]

    @classmethod
    def build(cls, seqs: list[SeqSpan]) -> VerifyGroup:
        qmax = max(s.q_len for s in seqs)
        width = max(len(s.ctx_slots) for s in seqs)
        B = len(seqs)
        table = torch.zeros(B, width, dtype=torch.long)
        rows = torch.empty(B, qmax, dtype=torch.long)
        last = torch.empty(B, qmax, dtype=torch.long)  # the last key each query may see
        for b, s in enumerate(seqs):
            ctx = len(s.ctx_slots)
            table[b, :ctx] = s.ctx_slots.cpu()
            i = torch.arange(qmax).clamp(max=s.q_len - 1)
            rows[b] = s.q_start + i
            last[b] = ctx - s.q_len + i
        real = (torch.arange(qmax).unsqueeze(0)
                < torch.tensor([s.q_len for s in seqs]).unsqueeze(1)).view(-1)
        bias = torch.zeros(B, 1, qmax, width).masked_fill_(
            torch.arange(width).view(1, 1, 1, -1) > last.view(B, 1, qmax, 1), float("-inf"))
        dev = seqs[0].ctx_slots.device
        return cls(rows.view(-1).to(dev), real.to(dev), table.view(-1).to(dev), bias.to(dev),
                   qmax, width)


@dataclass
class DecodeGroup:
    seqs: list[SeqSpan]
    rows: torch.Tensor  # long [B]: each sequence's row in the pack
    table: torch.Tensor  # long [B * W]: slots of each context, padded to the longest (W)
    mask: torch.Tensor  # bool [B, 1, 1, W]: True on real positions
    width: int
    whole: bool = False  # the sequences are the whole pack, in order (a decode-only step)
    _bias: dict = field(default_factory=dict)

    def bias(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The mask as an additive bias of `dtype` (0 / -inf), built once per step; None when
        no sequence is padded. SDPA turns a bool mask into this on every call (an aten::where
        per layer)."""
        if dtype not in self._bias:
            self._bias[dtype] = None if bool(self.mask.all()) else torch.zeros(
                self.mask.shape, dtype=dtype, device=self.mask.device).masked_fill_(
                ~self.mask, float("-inf"))
        return self._bias[dtype]

    @classmethod
    def build(cls, seqs: list[SeqSpan]) -> DecodeGroup:
        width = max(len(s.ctx_slots) for s in seqs)
        lens = torch.tensor([len(s.ctx_slots) for s in seqs])
        table = torch.zeros(len(seqs), width, dtype=torch.long, device=seqs[0].ctx_slots.device)
        for i, s in enumerate(seqs):  # padding points at slot 0 and is masked out
            table[i, : len(s.ctx_slots)] = s.ctx_slots
        mask = (torch.arange(width).unsqueeze(0) < lens.unsqueeze(1)).to(table.device)
        rows = torch.tensor([s.q_start for s in seqs], dtype=torch.long, device=table.device)
        return cls(seqs, rows, table.view(-1), mask[:, None, None, :], width)
