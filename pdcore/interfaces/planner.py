"""Transfer planner contract: how a set of KV pages becomes a CopyBatch.

Layout (per rank): per layer one K and one V buffer of [num_pages, page_size, kv_heads, head_dim];
`item_len` = bytes of one page of one layer (page_size * kv_heads * head_dim * elem_size).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

from pdcore.interfaces.transfer import CopyBatch


@dataclass(frozen=True, slots=True)
class KVLayout:
    num_layers: int
    page_size: int
    kv_heads: int  # heads held by this rank
    head_dim: int
    elem_size: int  # bytes per element
    k_bases: tuple[int, ...]  # address of layer i's K buffer
    v_bases: tuple[int, ...]
    num_pages: int
    tp_rank: int = 0
    tp_size: int = 1
    total_kv_heads: int = 0  # model's KV heads (0 = kv_heads * tp_size)
    dtype: str = "float32"
    is_mla: bool = False

    @property
    def item_len(self) -> int:
        return self.page_size * self.kv_heads * self.head_dim * self.elem_size

    @property
    def bytes_per_token(self) -> int:
        return self.kv_heads * self.head_dim * self.elem_size

    def to_dict(self) -> dict:
        return {f: getattr(self, f) for f in self.__slots__}  # type: ignore[attr-defined]

    @classmethod
    def from_dict(cls, d: dict) -> KVLayout:
        d = dict(d)
        d["k_bases"] = tuple(int(x) for x in d["k_bases"])
        d["v_bases"] = tuple(int(x) for x in d["v_bases"])
        return cls(**d)


class TransferPlanner(ABC):
    name: str = ""

    def supports(self, src: KVLayout, dst: KVLayout) -> tuple[bool, str]:
        """Whether this planner can map src -> dst; (False, why) otherwise."""
        return True, ""

    @abstractmethod
    def plan(
        self,
        src: KVLayout,
        dst: KVLayout,
        src_pages: np.ndarray,
        dst_pages: np.ndarray,
        token_count: int | None = None,
    ) -> CopyBatch:
        """Copies moving src_pages[i] -> dst_pages[i] for every layer's K and V.

        token_count: number of valid tokens covered by the pages (the last page may be partial);
        planners that copy per token slot use it; page-run planners may ignore it.
        """
