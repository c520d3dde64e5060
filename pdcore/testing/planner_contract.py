"""Contract suite for transfer planners: the CopyBatch must move exactly the requested bytes.

    from pdcore.testing.planner_contract import PlannerContract

    class TestMyPlanner(PlannerContract):
        planner_name = "staging"             # or override make_planner()

For each scenario, real K/V tensors are built for a source and a destination rank (source bytes
random, destination a random sentinel), the planner's batch is bounds-checked against those
tensors and then executed with ctypes.memmove. Afterwards every destination token slot holds
the source bytes of the heads both ranks own, and every other byte is unchanged. Slots past
`token_count` may be copied or left alone. Same-TP scenarios must be supported; a different-TP
scenario the planner declines through supports() is skipped with its reason.
"""

from __future__ import annotations

import ctypes
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from pdcore.errors import PDError
from pdcore.interfaces.planner import KVLayout, TransferPlanner
from pdcore.interfaces.transfer import CopyBatch
from pdcore.plugins.host import transfer_planners

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Rank:
    tp_rank: int
    tp_size: int
    kv_heads: int  # heads this rank holds


@dataclass(frozen=True)
class Scenario:
    name: str
    src: Rank
    dst: Rank
    src_pages: tuple[int, ...]
    dst_pages: tuple[int, ...]
    token_count: int | None = None
    dtype: str = "float32"
    required: bool = False  # must be supported by every planner
    num_layers: int = 2
    num_pages: int = 16
    page_size: int = 4
    head_dim: int = 8

    @property
    def total_heads(self) -> int:
        return self.src.kv_heads * self.src.tp_size


SCENARIOS = (
    Scenario("same_tp_runs", Rank(0, 1, 4), Rank(0, 1, 4), (2, 3, 4, 9, 10, 0, 7),
             (5, 6, 7, 1, 2, 12, 3), required=True),
    Scenario("same_tp_one_run_fp16", Rank(1, 2, 2), Rank(1, 2, 2), (0, 1, 2, 3),
             (10, 11, 12, 13), dtype="float16", required=True),
    Scenario("same_tp_single_page", Rank(0, 1, 2), Rank(0, 1, 2), (15,), (0,), required=True),
    Scenario("same_tp_no_pages", Rank(0, 1, 2), Rank(0, 1, 2), (), (), required=True),
    Scenario("tp1_to_tp2_rank0", Rank(0, 1, 4), Rank(0, 2, 2), (1, 2, 3), (4, 5, 9),
             token_count=10),
    Scenario("tp1_to_tp2_rank1", Rank(0, 1, 4), Rank(1, 2, 2), (1, 2, 3), (4, 5, 9),
             token_count=12),
    Scenario("tp2_rank1_to_tp1", Rank(1, 2, 2), Rank(0, 1, 4), (6, 7, 0), (1, 2, 3),
             token_count=9, dtype="float16"),
    Scenario("tp2_rank1_to_tp4_rank0_no_overlap", Rank(1, 2, 2), Rank(0, 4, 1), (6, 7),
             (1, 2), token_count=8),
)


@dataclass
class KVSide:
    layout: KVLayout
    k: list[torch.Tensor]
    v: list[torch.Tensor]

    def buffers(self) -> list[torch.Tensor]:
        return self.k + self.v

    def snapshot(self) -> list[np.ndarray]:
        """Bytes of every buffer, shaped [pages, page_size, heads, head_dim * elem]."""
        return [t.view(torch.uint8).numpy().copy() for t in self.buffers()]


def make_side(sc: Scenario, rank: Rank, rng: np.random.Generator) -> KVSide:
    dtype = DTYPES[sc.dtype]
    shape = (sc.num_pages, sc.page_size, rank.kv_heads, sc.head_dim)
    ks, vs = [], []
    for _ in range(sc.num_layers):
        for out in (ks, vs):
            t = torch.empty(shape, dtype=dtype)
            raw = rng.integers(0, 256, t.numel() * t.element_size(), dtype=np.uint8)
            t.view(torch.uint8).view(-1).copy_(torch.from_numpy(raw))
            out.append(t)
    layout = KVLayout(
        num_layers=sc.num_layers, page_size=sc.page_size, kv_heads=rank.kv_heads,
        head_dim=sc.head_dim, elem_size=ks[0].element_size(),
        k_bases=tuple(t.data_ptr() for t in ks), v_bases=tuple(t.data_ptr() for t in vs),
        num_pages=sc.num_pages, tp_rank=rank.tp_rank, tp_size=rank.tp_size,
        total_kv_heads=sc.total_heads, dtype=sc.dtype,
    )
    return KVSide(layout, ks, vs)


def _check_inside(addrs: np.ndarray, lengths: np.ndarray, tensors: Sequence[torch.Tensor],
                  what: str) -> None:
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors)
    starts = np.array([s for s, _ in spans], dtype=np.uint64)
    ends = np.array([e for _, e in spans], dtype=np.uint64)
    idx = np.searchsorted(starts, addrs, side="right").astype(np.int64) - 1
    ok = (idx >= 0) & (addrs + lengths <= ends[np.maximum(idx, 0)])
    assert ok.all(), (
        f"{int((~ok).sum())} copies reach outside the {what} buffers; first: addr "
        f"{int(addrs[~ok][0])} len {int(lengths[~ok][0])}")


def execute(batch: CopyBatch, src: KVSide, dst: KVSide) -> None:
    """Bounds-check every copy against the real tensors, then perform it with memmove."""
    src_a, dst_a, n = (np.asarray(a, dtype=np.uint64) for a in (batch.src, batch.dst,
                                                                 batch.length))
    _check_inside(src_a, n, src.buffers(), "source")
    _check_inside(dst_a, n, dst.buffers(), "destination")
    for s, d, ln in zip(src_a.tolist(), dst_a.tolist(), n.tolist(), strict=True):
        ctypes.memmove(d, s, ln)


def expected_after(sc: Scenario, src: list[np.ndarray], dst: list[np.ndarray],
                   copy_all_slots: bool) -> list[np.ndarray]:
    """Destination bytes after the transfer (slots past token_count copied or not)."""
    out = [d.copy() for d in dst]
    s0, d0 = sc.src.tp_rank * sc.src.kv_heads, sc.dst.tp_rank * sc.dst.kv_heads
    lo, hi = max(s0, d0), min(s0 + sc.src.kv_heads, d0 + sc.dst.kv_heads)
    if lo >= hi:
        return out
    for i, (sp, dp) in enumerate(zip(sc.src_pages, sc.dst_pages, strict=True)):
        for t in range(sc.page_size):
            if not copy_all_slots and sc.token_count is not None and \
                    i * sc.page_size + t >= sc.token_count:
                continue
            for s_buf, d_buf in zip(src, out, strict=True):
                d_buf[dp, t, lo - d0:hi - d0] = s_buf[sp, t, lo - s0:hi - s0]
    return out


class PlannerContract:
    planner_name: str = "default"

    def make_planner(self) -> TransferPlanner:
        entry = transfer_planners().get(self.planner_name)
        ok, reason = entry.available()
        if not ok:
            pytest.skip(f"planner {self.planner_name!r} is unavailable here: {reason}")
        return transfer_planners().create(self.planner_name)

    def test_is_planner(self) -> None:
        planner = self.make_planner()
        assert isinstance(planner, TransferPlanner)

    @pytest.mark.parametrize("sc", SCENARIOS, ids=[s.name for s in SCENARIOS])
    def test_moves_exactly_the_requested_bytes(self, sc: Scenario) -> None:
        planner = self.make_planner()
        rng = np.random.default_rng(zlib.crc32(sc.name.encode()))
        src, dst = make_side(sc, sc.src, rng), make_side(sc, sc.dst, rng)
        ok, why = planner.supports(src.layout, dst.layout)
        assert isinstance(ok, bool) and isinstance(why, str)
        if not ok:
            assert not sc.required, f"planner must support {sc.name}: {why}"
            pytest.skip(f"planner declines {sc.name}: {why}")
        before_src, before_dst = src.snapshot(), dst.snapshot()
        batch = planner.plan(src.layout, dst.layout, np.array(sc.src_pages, dtype=np.int64),
                             np.array(sc.dst_pages, dtype=np.int64), sc.token_count)
        assert isinstance(batch, CopyBatch)
        execute(batch, src, dst)
        strict = expected_after(sc, before_src, before_dst, copy_all_slots=False)
        loose = expected_after(sc, before_src, before_dst, copy_all_slots=True)
        for i, (actual, a, b) in enumerate(zip(dst.snapshot(), strict, loose, strict=True)):
            good = (actual == a) | (actual == b)
            assert good.all(), (f"{sc.name}: destination buffer {i} has {int((~good).sum())} "
                                f"wrong bytes")
        for i, (now, then) in enumerate(zip(src.snapshot(), before_src, strict=True)):
            assert np.array_equal(now, then), f"source buffer {i} was modified"
        per_slot = sc.dst.kv_heads * sc.head_dim * src.layout.elem_size  # upper bound per slot
        max_bytes = len(sc.src_pages) * sc.page_size * per_slot * 2 * sc.num_layers
        assert batch.nbytes <= max_bytes, f"{batch.nbytes} bytes planned; at most {max_bytes}"
        if sc.src == sc.dst and sc.token_count is None:  # same TP: whole pages, each once
            assert batch.nbytes == max_bytes

    def test_mismatched_page_lists_refused(self) -> None:
        planner = self.make_planner()
        sc = SCENARIOS[0]
        rng = np.random.default_rng(0)
        src, dst = make_side(sc, sc.src, rng), make_side(sc, sc.dst, rng)
        with pytest.raises((ValueError, PDError)):
            planner.plan(src.layout, dst.layout, np.array([1, 2, 3]), np.array([1, 2]))
