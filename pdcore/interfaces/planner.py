"""Transfer planner contract: how a set of KV pages becomes a CopyBatch.

Layout (per rank): per layer one K and one V buffer of [num_pages, page_size, kv_heads, head_dim];
`item_len` = bytes of one page of one layer (page_size * kv_heads * head_dim * elem_size). MLA
(`is_mla`): one latent buffer per layer (kv_heads 1, the same on every TP rank), v_bases ==
k_bases.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import numpy as np

from pdcore.interfaces.geometry import kv_head_span, model_kv_heads
from pdcore.interfaces.transfer import CopyBatch, MemoryRegion


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
    # of num_layers, the last ones a speculative draft head's (EAGLE / NEXTN: its one layer's
    # K/V, NEXTN's a latent as the target's MLA layers, at the target's own slots, so its pages
    # travel with the target's); 0: none
    draft_layers: int = 0

    @property
    def item_len(self) -> int:
        return self.page_size * self.kv_heads * self.head_dim * self.elem_size

    @property
    def bytes_per_token(self) -> int:
        return self.kv_heads * self.head_dim * self.elem_size

    @property
    def page_bytes(self) -> int:
        """KV bytes of one page over every layer: K and V, or the one latent buffer of MLA
        (whose v_bases repeat k_bases)."""
        return self.item_len * self.num_layers * (1 if self.is_mla else 2)

    @property
    def model_kv_heads(self) -> int:
        """The model's KV head count (from `total_kv_heads`, else kv_heads * tp_size)."""
        return model_kv_heads(self.total_kv_heads, self.kv_heads, self.tp_size)

    @property
    def head_span(self) -> tuple[int, int]:
        """(first, count) of the model's KV heads this rank's buffers hold: the first follows
        the engine's split (interfaces.geometry.kv_head_span), the count is what the buffers
        are shaped for."""
        return kv_head_span(self.model_kv_heads, self.tp_rank, self.tp_size)[0], self.kv_heads

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


# -- optional: staging (gather -> one bulk write -> scatter), for different TP sizes -----------


@dataclass(frozen=True, slots=True)
class StagingContext:
    """What a staging planner gets to set up one rank's staging memory."""

    layout: KVLayout  # this rank's KV layout
    kv: Sequence[tuple[Any, Any]]  # per layer (K, V) torch tensors [pages, page_size, heads, dim]
    pool: Any  # the KV MemoryPool: staging memory must be reachable by the same backend
    buffer_bytes: int  # prefill: bytes of each per-worker buffer
    ring_bytes: int  # decode: bytes of the ring pool
    workers: int  # prefill: transfer threads that may stage at the same time


class PrefillStaging(ABC):
    """P side: per-worker buffers a chunk's head slices are gathered into."""

    regions: Sequence[MemoryRegion] = ()  # registered with the transfer backend

    @abstractmethod
    def stage(self, dst: KVLayout, src_pages: np.ndarray, page_start: int, dst_num_pages: int,
              dst_addr: int, dst_len: int) -> AbstractContextManager[CopyBatch]:
        """Gather src_pages (D's pages [page_start, page_start + len)) into a free buffer and
        yield the CopyBatch moving it into D's grant [dst_addr, dst_addr + dst_len) (the room
        reserved dst_num_pages pages); the buffer is free again when the context exits.
        Raises TransferError when the chunk cannot be staged (larger than a buffer)."""

    def close(self) -> None:
        """Release the buffers."""


class DecodeStaging(ABC):
    """D side: a ring pool that rooms reserve grants in; scattered into the KV pages."""

    region: MemoryRegion  # registered with the backend and sent to P in Register

    @abstractmethod
    def grant_bytes(self, num_pages: int, prefill_tp: int) -> int:
        """Bytes a room of num_pages pages needs when P runs with TP prefill_tp."""

    @abstractmethod
    def reserve(self, nbytes: int) -> int | None:
        """Offset of a fresh grant inside `region`, or None while the ring is too full."""

    @abstractmethod
    def scatter(self, offset: int, dst_pages: np.ndarray, prefill_tp: int) -> None:
        """Copy a completed grant into the KV pages dst_pages (every writer has landed)."""

    @abstractmethod
    def free(self, offset: int) -> None:
        """Return a grant to the ring."""

    def stats(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        """Release the ring."""


class StagingPlanner(TransferPlanner):
    """A planner that moves KV between different TP sizes through staging memory: P gathers a
    chunk's head slices into one buffer, writes it in one descriptor into a grant D reserved
    in its ring, and D scatters the grant into its pages once every writer reported Success.
    Pairs `staged()` rejects (e.g. equal TP) use `plan()` as usual."""

    @abstractmethod
    def staged(self, src: KVLayout, dst: KVLayout) -> bool:
        """Whether KV from src to dst goes through staging."""

    @abstractmethod
    def open_prefill(self, ctx: StagingContext) -> PrefillStaging:
        """Staging buffers for a prefill rank; raises ConfigError when unsupported (MLA)."""

    @abstractmethod
    def open_decode(self, ctx: StagingContext) -> DecodeStaging:
        """The ring pool of a decode rank; raises ConfigError when unsupported (MLA)."""
