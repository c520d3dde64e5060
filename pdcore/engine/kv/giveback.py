"""Hand the KV pool's free, written pages back to the kernel when the engine is idle (#48).

Every decode batch writes K/V into pages that it frees at its end; on a host pool of untouched
zeros (builtin/torch_pool.py) those pages stay resident after the batch: 34-44 MiB of SmolLM2's
pool in s12. `BlockManager` remembers the pages handed out since the last give-back; once the
engine has been idle PDSERVE_KV_GIVEBACK_IDLE_S seconds (`IdleTimer`, run by rank 0's
scheduler loop and told to the other TP ranks in the lockstep header; default 2 s: bursty
traffic re-faults what each give-back dropped, ~0.2 ms a MiB, 10-60 ms for SmolLM2's 50 MiB in
s13, docs/cpu.md) the ones now free are advised away per layer buffer, over whole OS pages
inside runs of free pool pages: the kernel drops them and a later write faults in a fresh zero
page. Pages a request or the prefix cache (radix tree) holds have a reference, so they are
never among them. A free page's contents never matter (its next owner writes each position
before attention reads it; engine/kv/blocks.py), so zeroing is safe.

Only the plain host `torch` pool (`advice`): its private anonymous memory takes MADV_DONTNEED.
A unified server can run the `shm` pool (--memory-pool shm), but its pages are left alone: they
live in a /dev/shm segment's page cache, which DONTNEED does not free, and MADV_REMOVE (or a
punched hole) would free them by giving up the segment's reservation (builtin/shm_segment.py
reserves it with posix_fallocate on purpose): a later write into a removed page, with /dev/shm
filled by someone else meanwhile, kills the engine with SIGBUS instead of failing at start-up.
The THP pool (its huge pages would be split), device (CUDA) and pinned pools and a draft head's
buffers are left as they are too. A PD server (prefill or decode) gives nothing back (`allowed`):
its pool is registered with a transfer backend."""

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


def advice(kv) -> int | None:
    """The madvise advice that frees `kv`'s free pool pages: MADV_DONTNEED for the plain host
    `torch` pool; None for every other pool (nothing is given back; the module's docstring
    says why not for the `shm` pool)."""
    pool = kv.pool
    if (getattr(pool, "name", "") != "torch" or getattr(pool, "pinned", False)
            or not kv.layers or kv.layers[0][0].device.type != "cpu"):
        return None
    return MADV_DONTNEED


def give_back(kv, pages: list[int]) -> int:
    """Advise the OS pages wholly inside `pages` (free pool pages) of every target layer buffer
    of `kv` away (`advice`); returns the bytes advised (0 where the pool has no advice or libc
    has no madvise). Raises nothing: a failed call is logged and skipped."""
    fn = _madvise()
    how = advice(kv) if pages and fn is not None else None
    if how is None:
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
            if fn(start, end - start, how) != 0:
                log.debug("madvise(%d) of %d bytes failed: errno %d", how, end - start,
                          ctypes.get_errno())
                continue
            total += end - start
    return total


class IdleTimer:
    """When the engine's idle has lasted `min_idle_s`: the give-back is due once per idle
    (rank 0's scheduler loop: `idle` when it goes idle, `busy` when work comes, `due` at each
    idle poll; `now` is time.monotonic())."""

    def __init__(self, min_idle_s: float) -> None:
        self.min_idle_s = min_idle_s
        self.since: float | None = None  # when the engine went idle; None: busy, or given

    def idle(self, now: float) -> None:
        self.since = now

    def busy(self) -> None:
        self.since = None

    def due(self, now: float) -> float | None:
        """The idle gap when the give-back is due now (then not again this idle), else None."""
        if self.since is None or now - self.since < self.min_idle_s:
            return None
        gap, self.since = now - self.since, None
        return gap
