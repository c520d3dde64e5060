"""Hand the KV pool's free, written pages back to the kernel when the engine goes idle (#48).

Every decode batch writes K/V into pages that it frees at its end; on a host pool of untouched
zeros (builtin/torch_pool.py) those pages stay resident after the batch: 34-44 MiB of SmolLM2's
pool in s12. `BlockManager` remembers the pages handed out since the last give-back; at idle
(`ModelRunner.release_caches`) the ones now free are advised MADV_DONTNEED, per layer buffer,
over whole OS pages inside runs of free pool pages: the kernel drops them and a later write
faults in a fresh zero page. Pages a request or the prefix cache (radix tree) holds have a
reference, so they are never among them. A free page's contents never matter (its next owner
writes each position before attention reads it; engine/kv/blocks.py), so zeroing is safe.

Only the plain host `torch` pool: a shared-memory pool would need MADV_REMOVE (its pages live in
the segment, not the process) and the THP pool's huge pages would be split; both are left as
they are, as are device (CUDA) and pinned pools and a draft head's buffers. A PD server (prefill
or decode) gives nothing back (`allowed`): its pool is registered with a transfer backend."""

from __future__ import annotations

import ctypes
import logging
import mmap

import torch

log = logging.getLogger(__name__)

MADV_DONTNEED = 4
OS_PAGE = mmap.PAGESIZE
_LIBC: list = []


def _madvise():
    if not _LIBC:
        try:
            fn = ctypes.CDLL(None, use_errno=True).madvise
            fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            fn.restype = ctypes.c_int
            _LIBC.append(fn)
        except (OSError, AttributeError):  # no libc madvise: nothing is given back
            _LIBC.append(None)
    return _LIBC[0]


def runs(pages: list[int]) -> list[tuple[int, int]]:
    """[start, end) runs of consecutive pool pages in `pages` (any order, no duplicates)."""
    out: list[tuple[int, int]] = []
    for p in sorted(pages):
        if out and out[-1][1] == p:
            out[-1] = (out[-1][0], p + 1)
        else:
            out.append((p, p + 1))
    return out


def allowed(disaggregation_mode: str) -> bool:
    """Whether a server gives pages back at all: a unified server ("null") only. A prefill or
    decode server registers its pool with a transfer backend, and an RDMA registration pins the
    physical pages: a page advised away would fault back in as another physical page than the
    one the NIC reads or writes, and transfers would go to memory the process no longer sees."""
    return disaggregation_mode == "null"


def plain_host_pool(kv) -> bool:
    """True for the pool this module may advise: the `torch` pool over host memory."""
    pool = kv.pool
    return (getattr(pool, "name", "") == "torch" and not getattr(pool, "pinned", False)
            and bool(kv.layers) and kv.layers[0][0].device.type == "cpu")


def give_back(kv, pages: list[int]) -> int:
    """Advise MADV_DONTNEED over the OS pages wholly inside `pages` (free pool pages) of every
    target layer buffer of `kv`; returns the bytes advised (0 where the pool is not a plain
    host pool or libc has no madvise). Raises nothing: a failed call is logged and skipped."""
    fn = _madvise()
    if not pages or fn is None or not plain_host_pool(kv):
        return 0
    bufs: list[torch.Tensor] = [k for k, _ in kv.layers]
    if not kv.is_mla:
        bufs += [v for _, v in kv.layers]
    spans = runs(pages)
    total = 0
    for buf in bufs:
        page_bytes = buf.stride(0) * buf.element_size()
        base = buf.data_ptr()
        for a, b in spans:
            start = -(-(base + a * page_bytes) // OS_PAGE) * OS_PAGE
            end = (base + b * page_bytes) // OS_PAGE * OS_PAGE
            if end <= start:
                continue
            if fn(start, end - start, MADV_DONTNEED) != 0:
                log.debug("madvise(DONTNEED) of %d bytes failed: errno %d", end - start,
                          ctypes.get_errno())
                continue
            total += end - start
    return total
