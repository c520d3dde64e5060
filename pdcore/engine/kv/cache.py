"""The paged KV pool: per layer one K and one V buffer of [num_pages, page_size, kv_heads,
head_dim], allocated by the memory-pool plugin so a transfer backend can register them.

MLA models (`is_mla`) cache one latent row per token and layer (kv_heads 1, head_dim
kv_lora_rank + rope dim), the same on every TP rank. The latent is both the key and the value
source, so there is no V buffer: a layer's V entry is its K buffer (`layers[i] == (k, k)`,
`v_bases == k_bases`); planners that know MLA copy it once, others copy it twice, harmlessly.

A PD server with a draft head (EAGLE, NEXTN) allocates the head's one-layer K/V pool here too
(`draft_buffer`): addressed by the target's slots, it is one more layer of the same page
geometry (plus the head's scratch pages past the pool's), so `layout()` / `regions()` /
`transfer_layers` list it after the target's layers (`KVLayout.draft_layers`) and a PD
transfer moves a request's draft K/V with its pages. NEXTN's head is MLA (`latent`): one latent
buffer, one more MLA layer (its V entry its K buffer). The model's `layers` never include it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdcore.errors import ConfigError
from pdcore.interfaces.geometry import model_kv_heads
from pdcore.interfaces.memory import MemoryPool
from pdcore.interfaces.planner import KVLayout
from pdcore.interfaces.transfer import MemoryRegion


@dataclass(frozen=True)
class KVSpec:
    """The pool geometry a model needs on one rank (its `kv_spec()`; engine/build.py:kv_spec
    gives the Llama rule): the KV heads this rank holds, each `head_dim` wide, of the model's
    `total_kv_heads`; MLA (`is_mla`): one latent 'head' per token, the same on every rank."""

    kv_heads: int
    head_dim: int
    total_kv_heads: int
    is_mla: bool = False


class KVCache:
    def __init__(self, pool: MemoryPool, num_layers: int, num_pages: int, page_size: int,
                 kv_heads: int, head_dim: int, *, dtype: torch.dtype, tp_rank: int = 0,
                 tp_size: int = 1, total_kv_heads: int | None = None,
                 is_mla: bool = False) -> None:
        self.pool = pool
        self.num_pages, self.page_size = num_pages, page_size
        self.kv_heads, self.head_dim, self.dtype = kv_heads, head_dim, dtype
        self.tp_rank, self.tp_size, self.is_mla = tp_rank, tp_size, is_mla
        self.total_kv_heads = model_kv_heads(total_kv_heads, kv_heads, tp_size)
        shape = (num_pages, page_size, kv_heads, head_dim)
        self.k_bufs = [pool.allocate(f"k{i}", shape, dtype) for i in range(num_layers)]
        self.v_bufs = ([] if is_mla else
                       [pool.allocate(f"v{i}", shape, dtype) for i in range(num_layers)])
        self.layers = [(k.tensor, v.tensor) for k, v in zip(self.k_bufs, self._v_or_k())]
        self.draft_k: list = []  # the draft head's buffers (Buffer), after the target's
        self.draft_v: list = []

    def draft_buffer(self, label: str, shape: tuple[int, ...], dtype: torch.dtype,
                     latent: bool = False) -> torch.Tensor:
        """A draft head's K (label "draft_k") or V ("draft_v") pool, from this pool's memory so
        the transfer backend registers it: [pages >= num_pages, page_size, heads, head_dim],
        page for page the target's geometry (ConfigError otherwise: it could not travel as one
        more layer). `latent`: one buffer serves as K and V (MLA), as the target's must."""
        pages, ps, heads, dim = shape
        want = (self.page_size, self.kv_heads, self.head_dim, self.dtype, self.is_mla)
        got = (ps, heads, dim, dtype, latent)
        if pages < self.num_pages or got != want:
            raise ConfigError(
                "a draft head's KV pool travels with the target's in PD mode as one more layer "
                f"of the same page geometry; the head's (page size, KV heads, head dim, dtype, "
                f"latent) are {got}, the target's {want}: use a head of the target's attention "
                "shape and --kv-cache-dtype auto, or --disaggregation-mode null")
        buf = self.pool.allocate(label, shape, dtype)
        (self.draft_v if label.endswith("_v") else self.draft_k).append(buf)
        return buf.tensor

    @property
    def transfer_layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every (K, V) a PD transfer moves: the target's layers, then the draft head's."""
        v = self.draft_k if self.is_mla else self.draft_v
        return self.layers + [(k.tensor, b.tensor) for k, b in zip(self.draft_k, v)]

    def _v_or_k(self) -> list:
        return self.k_bufs if self.is_mla else self.v_bufs

    @staticmethod
    def bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                        is_mla: bool = False) -> int:
        """Bytes one token occupies in the pool of one rank (all layers)."""
        per_layer = kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()
        return num_layers * per_layer * (1 if is_mla else 2)

    def regions(self) -> list[MemoryRegion]:
        return [b.region for b in self.k_bufs + self.v_bufs + self.draft_k + self.draft_v]

    def layout(self) -> KVLayout:
        return KVLayout(
            num_layers=len(self.layers) + len(self.draft_k), page_size=self.page_size,
            kv_heads=self.kv_heads, head_dim=self.head_dim,
            elem_size=self.layers[0][0].element_size(),
            k_bases=tuple(b.region.addr for b in self.k_bufs + self.draft_k),
            v_bases=tuple(b.region.addr for b in self._v_or_k()
                          + (self.draft_k if self.is_mla else self.draft_v)),
            num_pages=self.num_pages, tp_rank=self.tp_rank, tp_size=self.tp_size,
            total_kv_heads=self.total_kv_heads, dtype=str(self.dtype).replace("torch.", ""),
            is_mla=self.is_mla, draft_layers=len(self.draft_k),
        )

    def close(self) -> None:
        self.layers = []
        self.pool.close()
