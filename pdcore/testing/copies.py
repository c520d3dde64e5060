"""Random scattered copy plans between sets of byte buffers, and the bytes they must produce.

A `CopyPlan` is a list of (src buffer, src offset, dst buffer, dst offset, length) items whose
destination ranges never overlap, so the expected destination content is well defined. It turns
into a CopyBatch of absolute addresses once the regions are known (the peer's may live in
another process).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pdcore.interfaces.transfer import (
    CopyBatch,
    MemoryRegion,
    PollResult,
    TransferEngine,
    TransferStatus,
    failed,
)

# sizes a real KV transfer meets: tiny aux rows, odd lengths, page sizes, page runs
DEFAULT_SIZES = (1, 3, 8, 63, 64, 65, 511, 1024, 4095, 4096, 4097, 16384, 65536)


@dataclass(frozen=True, slots=True)
class CopyPlan:
    src_buf: np.ndarray  # int64 index of the source buffer of each item
    src_off: np.ndarray
    dst_buf: np.ndarray
    dst_off: np.ndarray
    length: np.ndarray

    def __len__(self) -> int:
        return len(self.length)

    @property
    def nbytes(self) -> int:
        return int(self.length.sum())

    def batch(self, src: Sequence[MemoryRegion], dst: Sequence[MemoryRegion]) -> CopyBatch:
        src_base = np.array([r.addr for r in src], dtype=np.uint64)
        dst_base = np.array([r.addr for r in dst], dtype=np.uint64)
        return CopyBatch(
            (src_base[self.src_buf] + self.src_off.astype(np.uint64)).astype(np.uint64),
            (dst_base[self.dst_buf] + self.dst_off.astype(np.uint64)).astype(np.uint64),
            self.length.astype(np.uint64),
        )

    def apply(self, src: Sequence[np.ndarray], expected_dst: Sequence[np.ndarray]) -> None:
        """Do the copies on numpy byte arrays: what the destination must hold afterwards."""
        for sb, so, db, do, n in zip(self.src_buf, self.src_off, self.dst_buf, self.dst_off,
                                     self.length, strict=True):
            expected_dst[db][do:do + n] = src[sb][so:so + n]

    def take(self, index: np.ndarray) -> CopyPlan:
        return CopyPlan(self.src_buf[index], self.src_off[index], self.dst_buf[index],
                        self.dst_off[index], self.length[index])

    def split(self, parts: int) -> list[CopyPlan]:
        return [self.take(ix) for ix in np.array_split(np.arange(len(self)), parts)]


def _place(rng: np.random.Generator, sizes: np.ndarray, capacity: int) -> np.ndarray:
    """Disjoint offsets for `sizes` inside `capacity` bytes, in random order with random gaps."""
    slack = capacity - int(sizes.sum())
    if slack < 0:
        raise ValueError(f"{int(sizes.sum())} bytes of copies do not fit {capacity} bytes")
    order = rng.permutation(len(sizes))
    gaps = np.sort(rng.integers(0, slack + 1, size=len(sizes)))
    ordered = sizes[order]
    offsets = np.empty(len(sizes), dtype=np.int64)
    offsets[order] = gaps + np.cumsum(ordered) - ordered
    return offsets


def random_plan(rng: np.random.Generator, n_items: int, src_sizes: Sequence[int],
                dst_sizes: Sequence[int], sizes: Sequence[int] = DEFAULT_SIZES,
                fill: float = 0.6) -> CopyPlan:
    """n_items copies with lengths drawn from `sizes`, scaled down so they use at most `fill`
    of each destination buffer."""
    n_dst = len(dst_sizes)
    dst_buf = rng.integers(0, n_dst, size=n_items)
    length = rng.choice(np.asarray(sizes, dtype=np.int64), size=n_items)
    dst_off = np.zeros(n_items, dtype=np.int64)
    for b in range(n_dst):
        mask = dst_buf == b
        budget = int(dst_sizes[b] * fill)
        if int(mask.sum()) > budget:
            raise ValueError(f"{int(mask.sum())} copies cannot fit {budget} bytes of buffer {b}")
        while int(length[mask].sum()) > budget:  # too many bytes for this buffer: shrink
            length[mask] = np.maximum(length[mask] // 2, 1)
        dst_off[mask] = _place(rng, length[mask], dst_sizes[b])
    src_buf = rng.integers(0, len(src_sizes), size=n_items)
    src_cap = np.asarray(src_sizes, dtype=np.int64)[src_buf]
    length = np.minimum(length, src_cap)
    src_off = (rng.random(n_items) * (src_cap - length + 1)).astype(np.int64)
    return CopyPlan(src_buf.astype(np.int64), src_off, dst_buf.astype(np.int64), dst_off,
                    length.astype(np.int64))


def wait_all(engine: TransferEngine, handles: Sequence[int], timeout: float) -> list[PollResult]:
    """Poll every handle until none is PENDING; a handle still pending at `timeout` becomes
    FAILED("still pending after ...") so a hung backend fails the test instead of hanging it."""
    results: dict[int, PollResult] = {}
    deadline = time.monotonic() + timeout
    while len(results) < len(handles):
        for i, h in enumerate(handles):
            if i not in results:
                r = engine.poll(h)
                if r.status is not TransferStatus.PENDING:
                    results[i] = r
        if len(results) == len(handles):
            break
        if time.monotonic() > deadline:
            for i in range(len(handles)):
                results.setdefault(i, failed(f"still pending after {timeout}s"))
            break
        time.sleep(0.0005)
    return [results[i] for i in range(len(handles))]


def first_difference(actual: np.ndarray, expected: np.ndarray) -> str:
    """A short description of where two byte arrays differ (for assertion messages)."""
    if actual.shape != expected.shape:
        return f"shape {actual.shape} != {expected.shape}"
    bad = np.flatnonzero(actual != expected)
    if not len(bad):
        return "identical"
    i = int(bad[0])
    return (f"{len(bad)} byte(s) differ; first at offset {i}: got {int(actual[i])}, "
            f"expected {int(expected[i])}")
