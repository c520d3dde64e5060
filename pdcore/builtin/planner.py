"""Default transfer planner: KV page indices -> one CopyBatch of absolute (src, dst, len).

Same TP: page pairs are grouped into runs that are consecutive on both sides; per run and per
layer the K and V copies are one descriptor each of `run_len * item_len` bytes. MLA (any TP
sizes): the latent KV is the same on every rank, so whole-page runs of the one latent buffer per
layer (no V), written by one P rank per D rank (`mla_sender`); the others plan nothing. Different TP (non-MLA): each side owns a slice of the model's KV heads; per token slot we
copy the intersection of the two slices (`KVLayout.head_span`; GQA replication: when
tp > total_kv_heads, several ranks hold the same head). Everything is vectorised with numpy; no
Python loop per page or per token.
"""

from __future__ import annotations

import numpy as np

from pdcore.interfaces.geometry import mla_sender
from pdcore.interfaces.planner import KVLayout, TransferPlanner
from pdcore.interfaces.transfer import CopyBatch


def page_runs(src_pages: np.ndarray, dst_pages: np.ndarray) -> tuple[np.ndarray, np.ndarray,
                                                                     np.ndarray]:
    """(src_start, dst_start, run_len) of maximal runs consecutive on both sides."""
    src = np.asarray(src_pages, dtype=np.int64).ravel()
    dst = np.asarray(dst_pages, dtype=np.int64).ravel()
    n = len(src)
    if n == 0:
        z = np.zeros(0, dtype=np.int64)
        return z, z, z
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    lens = np.diff(np.concatenate((starts, [n])))
    return src[starts], dst[starts], lens


def _same_heads(src: KVLayout, dst: KVLayout) -> bool:
    # e.g. GQA replication: both ranks hold exactly the same heads, so whole pages line up
    return src.kv_heads == dst.kv_heads and src.head_span == dst.head_span


class DefaultPlanner(TransferPlanner):
    name = "default"

    def supports(self, src: KVLayout, dst: KVLayout) -> tuple[bool, str]:
        for field in ("page_size", "head_dim", "elem_size", "num_layers", "dtype", "is_mla"):
            a, b = getattr(src, field), getattr(dst, field)
            if a != b:
                return False, (f"prefill and decode KV layouts differ in {field} ({a} vs {b}); "
                               f"start both servers with the same model, dtype and --page-size")
        if src.is_mla:
            if src.kv_heads != dst.kv_heads:
                return False, (f"MLA latent heads differ ({src.kv_heads} vs {dst.kv_heads}); "
                               "they must serve the same model")
            return True, ""  # every rank holds the whole latent cache
        src_total, dst_total = src.model_kv_heads, dst.model_kv_heads
        if src_total != dst_total:
            return False, (f"prefill and decode disagree on the model's KV heads "
                           f"({src_total} vs {dst_total}); they must serve the same model")
        s0, sn = src.head_span
        d0, dn = dst.head_span
        if max(s0, d0) >= min(s0 + sn, d0 + dn):
            return False, (f"prefill rank {src.tp_rank}/{src.tp_size} holds KV heads "
                           f"[{s0}, {s0 + sn}) and decode rank {dst.tp_rank}/{dst.tp_size} holds "
                           f"[{d0}, {d0 + dn}): no overlap, this pair exchanges nothing")
        return True, ""

    def plan(
        self,
        src: KVLayout,
        dst: KVLayout,
        src_pages: np.ndarray,
        dst_pages: np.ndarray,
        token_count: int | None = None,
    ) -> CopyBatch:
        src_pages = np.asarray(src_pages, dtype=np.int64).ravel()
        dst_pages = np.asarray(dst_pages, dtype=np.int64).ravel()
        if len(src_pages) != len(dst_pages):
            raise ValueError(f"plan: {len(src_pages)} source pages but {len(dst_pages)} "
                             f"destination pages; they must pair up one to one")
        ok, why = self.supports(src, dst)
        if not ok:
            raise ValueError(why)
        if len(src_pages) == 0:
            return CopyBatch.empty()
        if src.is_mla:
            if not mla_sender(src.tp_rank, src.tp_size, dst.tp_rank):
                return CopyBatch.empty()
            return self._plan_runs(src, dst, src_pages, dst_pages, mla=True)
        if _same_heads(src, dst):
            return self._plan_runs(src, dst, src_pages, dst_pages)
        return self._plan_slices(src, dst, src_pages, dst_pages, token_count)

    @staticmethod
    def _plan_runs(src: KVLayout, dst: KVLayout, src_pages: np.ndarray,
                   dst_pages: np.ndarray, mla: bool = False) -> CopyBatch:
        s_start, d_start, lens = page_runs(src_pages, dst_pages)
        item = src.item_len
        # MLA: v_bases repeat k_bases (one latent buffer per layer): copy it once
        s_bases = np.array(src.k_bases + (() if mla else src.v_bases), dtype=np.uint64)[:, None]
        d_bases = np.array(dst.k_bases + (() if mla else dst.v_bases), dtype=np.uint64)[:, None]
        s_off = (s_start.astype(np.uint64) * np.uint64(item))[None, :]
        d_off = (d_start.astype(np.uint64) * np.uint64(item))[None, :]
        length = np.broadcast_to((lens.astype(np.uint64) * np.uint64(item))[None, :],
                                 (len(s_bases), len(lens)))
        return CopyBatch((s_bases + s_off).ravel(), (d_bases + d_off).ravel(),
                         np.ascontiguousarray(length).ravel())

    @staticmethod
    def _plan_slices(src: KVLayout, dst: KVLayout, src_pages: np.ndarray, dst_pages: np.ndarray,
                     token_count: int | None) -> CopyBatch:
        s0, sn = src.head_span
        d0, dn = dst.head_span
        first, last = max(s0, d0), min(s0 + sn, d0 + dn)
        bytes_per_head = src.head_dim * src.elem_size
        page_size = src.page_size
        slots = np.arange(len(src_pages) * page_size, dtype=np.int64)
        if token_count is not None:
            slots = slots[: max(0, min(int(token_count), len(slots)))]
        page_idx, slot_in_page = slots // page_size, slots % page_size
        s_tok = (src_pages[page_idx] * src.item_len + slot_in_page * src.bytes_per_token
                 + (first - s0) * bytes_per_head).astype(np.uint64)
        d_tok = (dst_pages[page_idx] * dst.item_len + slot_in_page * dst.bytes_per_token
                 + (first - d0) * bytes_per_head).astype(np.uint64)
        s_bases = np.array(src.k_bases + src.v_bases, dtype=np.uint64)[:, None]
        d_bases = np.array(dst.k_bases + dst.v_bases, dtype=np.uint64)[:, None]
        n = len(s_bases) * len(slots)
        length = np.full(n, (last - first) * bytes_per_head, dtype=np.uint64)
        return CopyBatch((s_bases + s_tok[None, :]).ravel(), (d_bases + d_tok[None, :]).ravel(),
                         length)
