"""Reference planners used to test the planner contract suite itself.

RefPlanner copies, per page pair and token slot, the heads both ranks own (any TP pair).
ShiftedPlanner has a deliberate bug (writes one page too far) that the suite must catch.
"""

from __future__ import annotations

import numpy as np

from pdcore.interfaces.planner import KVLayout, TransferPlanner
from pdcore.interfaces.transfer import CopyBatch


class RefPlanner(TransferPlanner):
    name = "ref"

    def plan(self, src: KVLayout, dst: KVLayout, src_pages: np.ndarray, dst_pages: np.ndarray,
             token_count: int | None = None) -> CopyBatch:
        if len(src_pages) != len(dst_pages):
            raise ValueError(f"{len(src_pages)} source pages but {len(dst_pages)} destination")
        s0, d0 = src.tp_rank * src.kv_heads, dst.tp_rank * dst.kv_heads
        lo, hi = max(s0, d0), min(s0 + src.kv_heads, d0 + dst.kv_heads)
        rows: list[tuple[int, int, int]] = []
        head = src.head_dim * src.elem_size
        for i, (sp, dp) in enumerate(zip(src_pages.tolist(), dst_pages.tolist(), strict=True)):
            for t in range(src.page_size):
                if lo >= hi or (token_count is not None and i * src.page_size + t >= token_count):
                    continue
                so = sp * src.item_len + t * src.bytes_per_token + (lo - s0) * head
                do = self.dst_page_offset(dst, dp) + t * dst.bytes_per_token + (lo - d0) * head
                for sb, db in zip(src.k_bases + src.v_bases, dst.k_bases + dst.v_bases,
                                  strict=True):
                    rows.append((sb + so, db + do, (hi - lo) * head))
        if not rows:
            return CopyBatch.empty()
        a = np.array(rows, dtype=np.uint64)
        return CopyBatch(a[:, 0].copy(), a[:, 1].copy(), a[:, 2].copy())

    def dst_page_offset(self, dst: KVLayout, page: int) -> int:
        return page * dst.item_len


class ShiftedPlanner(RefPlanner):
    def dst_page_offset(self, dst: KVLayout, page: int) -> int:
        return ((page + 1) % dst.num_pages) * dst.item_len
