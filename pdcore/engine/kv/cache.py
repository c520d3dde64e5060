"""The paged KV pool: per layer one K and one V buffer of [num_pages, page_size, kv_heads,
head_dim], allocated by the memory-pool plugin so a transfer backend can register them.

MLA models (`is_mla`) cache one latent row per token and layer (kv_heads 1, head_dim
kv_lora_rank + rope dim), the same on every TP rank. The latent is both the key and the value
source, so there is no V buffer: a layer's V entry is its K buffer (`layers[i] == (k, k)`,
`v_bases == k_bases`); planners that know MLA copy it once, others copy it twice, harmlessly."""

from __future__ import annotations

import torch

from pdcore.interfaces.geometry import model_kv_heads
from pdcore.interfaces.memory import MemoryPool
from pdcore.interfaces.planner import KVLayout
from pdcore.interfaces.transfer import MemoryRegion


class KVCache:
    def __init__(self, pool: MemoryPool, num_layers: int, num_pages: int, page_size: int,
                 kv_heads: int, head_dim: int, dtype: torch.dtype, tp_rank: int = 0,
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

    def _v_or_k(self) -> list:
        return self.k_bufs if self.is_mla else self.v_bufs

    @staticmethod
    def bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                        is_mla: bool = False) -> int:
        """Bytes one token occupies in the pool of one rank (all layers)."""
        per_layer = kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()
        return num_layers * per_layer * (1 if is_mla else 2)

    def regions(self) -> list[MemoryRegion]:
        return [b.region for b in self.k_bufs + self.v_bufs]

    def layout(self) -> KVLayout:
        return KVLayout(
            num_layers=len(self.layers), page_size=self.page_size, kv_heads=self.kv_heads,
            head_dim=self.head_dim, elem_size=self.layers[0][0].element_size(),
            k_bases=tuple(b.region.addr for b in self.k_bufs),
            v_bases=tuple(b.region.addr for b in self._v_or_k()),
            num_pages=self.num_pages, tp_rank=self.tp_rank, tp_size=self.tp_size,
            total_kv_heads=self.total_kv_heads, dtype=str(self.dtype).replace("torch.", ""),
            is_mla=self.is_mla,
        )

    def close(self) -> None:
        self.layers = []
        self.pool.close()
