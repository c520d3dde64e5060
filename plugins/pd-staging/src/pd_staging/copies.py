"""The two local copies of a staged transfer, per layer and per run of consecutive pages.

Staged data is page-major: `[pages, 2 * layers, page_size, heads, head_dim]` (K layers, then V
layers, per page). A page of one layer for the heads a writer sends is then one contiguous
block in the staging buffer, and when the writer sends all the heads it holds (P TP > D TP)
it is contiguous in the KV pool too, so the gather is plain block copies. A run of consecutive
pages is one strided view per layer (no index tensor, no temporary); pages scattered over many
runs fall back to one indexed copy per layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

MAX_RUNS = 8  # beyond this many runs one indexed copy per layer is cheaper than many slices


def page_runs(pages: np.ndarray) -> list[tuple[int, int, int]]:
    """(first page, pages in the run, index of the run's first page in `pages`)."""
    p = np.asarray(pages, dtype=np.int64).ravel()
    if len(p) == 0:
        return []
    breaks = np.flatnonzero(np.diff(p) != 1) + 1
    starts = np.concatenate(([0], breaks))
    lens = np.diff(np.concatenate((starts, [len(p)])))
    return [(int(p[s]), int(n), int(s)) for s, n in zip(starts, lens)]


def gather(kv: Sequence[tuple[Any, Any]], pages: np.ndarray, heads: slice,
           out: torch.Tensor) -> None:
    """out[j, l] = K_l[pages[j], :, heads]; out[j, L + l] = V_l[...].
    out: [len(pages), 2L, page_size, h, dim]."""
    n_layers = len(kv)
    runs = page_runs(pages)
    if len(runs) <= MAX_RUNS:
        for first, n, at in runs:
            for i, (k, v) in enumerate(kv):
                out[at:at + n, i].copy_(k[first:first + n, :, heads])
                out[at:at + n, n_layers + i].copy_(v[first:first + n, :, heads])
        return
    idx = torch.as_tensor(np.asarray(pages, dtype=np.int64), device=out.device)
    for i, (k, v) in enumerate(kv):
        out[:, i] = k.index_select(0, idx)[:, :, heads]
        out[:, n_layers + i] = v.index_select(0, idx)[:, :, heads]


def scatter(kv: Sequence[tuple[Any, Any]], pages: np.ndarray, heads: slice,
            block: torch.Tensor) -> None:
    """The inverse of gather: K_l[pages[j], :, heads] = block[j, l] (and V)."""
    n_layers = len(kv)
    runs = page_runs(pages)
    if len(runs) <= MAX_RUNS:
        for first, n, at in runs:
            for i, (k, v) in enumerate(kv):
                k[first:first + n, :, heads].copy_(block[at:at + n, i])
                v[first:first + n, :, heads].copy_(block[at:at + n, n_layers + i])
        return
    idx = torch.as_tensor(np.asarray(pages, dtype=np.int64), device=block.device)
    for i, (k, v) in enumerate(kv):
        k[idx, :, heads] = block[:, i]
        v[idx, :, heads] = block[:, n_layers + i]
