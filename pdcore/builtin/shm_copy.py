"""Batched memory copies for the shm backend: many (dst, src, len) items, no Python per byte.

A batch is built once as two `struct iovec` arrays (`iovecs`); row slices of them are the
chunks the backend's copy threads run.

Into a peer's segment mapped here (segment mode), chosen by PDCORE_SHM_COPY (ctx.env); unset
means `vm` where the probe shows it works, else `memmove`:

- `vm` (`writev` on our own pid): process_vm_writev(2), up to IOV_MAX items per system call. The
  GIL is released for the whole call, so the backend's copy threads run truly in parallel and
  the server's other Python threads are not slowed; a destination that is no longer mapped gives
  EFAULT instead of a crash. Measured here (bench/transfer.py, scattered 12 KiB pages, 2 cores):
  2.7-3.8 GB/s against 1.8-1.9 GB/s for `memmove`. Some sandboxes (seccomp) forbid the call: it
  is probed first.
- `memmove` (`memmove_iov`): ctypes.memmove per item; the GIL is released inside each call only,
  so parallel threads mostly take turns on the GIL between items.

Into another process's private memory (cma mode): `writev(..., pid=peer)`, the same system call
with the peer's pid (cross-memory attach; the kernel checks ptrace access: same user, and Yama's
ptrace_scope 0 or CAP_SYS_PTRACE). `read_word` reads the peer's identity nonce the same way.
`cma_permitted()` says whether such peers can be reached here at all.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import os

import numpy as np

from pdcore.errors import ConfigError

COPY_ENV = "PDCORE_SHM_COPY"
STRATEGIES = ("memmove", "vm")
IOV_MAX = 1024


CAP_SYS_PTRACE = 19
YAMA_SCOPE = "/proc/sys/kernel/yama/ptrace_scope"


@functools.lru_cache(maxsize=2)
def _vm_call(name: str):
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    fn = getattr(libc, name, None)
    if fn is None:
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p,
                   ctypes.c_ulong, ctypes.c_ulong]
    fn.restype = ctypes.c_ssize_t
    return fn


def iovecs(dst: np.ndarray, src: np.ndarray, length: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(local, remote): `struct iovec` arrays ([n, 2] uint64: base, length) of items `src` ->
    `dst`. Row slices of both stay valid iovec arrays, so one batch is built once and split."""
    n = len(length)
    local = np.empty((n, 2), dtype=np.uint64)
    remote = np.empty((n, 2), dtype=np.uint64)
    local[:, 0], local[:, 1] = src, length
    remote[:, 0], remote[:, 1] = dst, length
    return local, remote


def writev(local: np.ndarray, remote: np.ndarray, pid: int = 0) -> None:
    """Copy the `local` iovecs of this process into the `remote` iovecs of process `pid` (0: this
    process), IOV_MAX items per system call; OSError when the kernel copies less."""
    fn = _vm_call("process_vm_writev")
    if fn is None:
        raise OSError("process_vm_writev is not available in this C library")
    pid = pid or os.getpid()
    n = len(local)
    lbase, rbase = local.ctypes.data, remote.ctypes.data
    for i in range(0, n, IOV_MAX):
        k = min(IOV_MAX, n - i)
        want = int(local[i:i + k, 1].sum())
        got = fn(pid, lbase + 16 * i, k, rbase + 16 * i, k, 0)
        if got != want:
            err = ctypes.get_errno() if got < 0 else 0
            raise OSError(err, f"process_vm_writev copied {got} of {want} bytes"
                               + (f": {os.strerror(err)}" if err else ""))


def read_word(pid: int, addr: int, nbytes: int = 16) -> bytes:
    """`nbytes` at `addr` in process `pid`; OSError(errno) when the kernel refuses (ESRCH: no such
    process, EFAULT: not mapped there, EPERM: no ptrace access)."""
    fn = _vm_call("process_vm_readv")
    if fn is None:
        raise OSError(errno.ENOSYS, "process_vm_readv is not available in this C library")
    buf = ctypes.create_string_buffer(nbytes)
    local = (ctypes.c_uint64 * 2)(ctypes.addressof(buf), nbytes)
    remote = (ctypes.c_uint64 * 2)(addr, nbytes)
    got = fn(pid, ctypes.addressof(local), 1, ctypes.addressof(remote), 1, 0)
    if got != nbytes:
        err = ctypes.get_errno() if got < 0 else errno.EFAULT
        raise OSError(err, os.strerror(err))
    return buf.raw


def memmove_iov(local: np.ndarray, remote: np.ndarray, pid: int = 0) -> None:
    """`writev` within this process by ctypes.memmove per item (where the system call is
    forbidden); `pid` must be 0."""
    if pid:
        raise OSError(errno.EINVAL, "memmove copies only within this process")
    move = ctypes.memmove
    for d, s, k in zip(remote[:, 0].tolist(), local[:, 0].tolist(), local[:, 1].tolist()):
        move(d, s, k)


@functools.lru_cache(maxsize=1)
def vm_works() -> bool:
    """Whether process_vm_writev on ourselves runs here (seccomp may forbid it)."""
    a = np.arange(64, dtype=np.uint8)
    b = np.zeros(64, dtype=np.uint8)
    u = np.uint64
    try:
        writev(*iovecs(np.array([b.ctypes.data], u), np.array([a.ctypes.data], u),
                       np.array([64], u)))
    except OSError:
        return False
    return bool((a == b).all())


def pick(strategy: str):
    """(name, copy function `f(local_iov, remote_iov)` like `writev`) for a PDCORE_SHM_COPY
    value ('' = vm if permitted, else memmove)."""
    strategy = (strategy or "").strip().lower()
    if not strategy:
        return ("vm", writev) if vm_works() else ("memmove", memmove_iov)
    if strategy not in STRATEGIES:
        raise ConfigError(f"{COPY_ENV} must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    if strategy == "vm":
        if not vm_works():
            raise ConfigError(f"{COPY_ENV}=vm but process_vm_writev is not permitted here "
                              f"(seccomp?); use {COPY_ENV}=memmove")
        return "vm", writev
    return "memmove", memmove_iov


def _yama_scope() -> int | None:
    try:
        with open(YAMA_SCOPE) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None  # no Yama: the classic same-user rule


def _has_cap_ptrace() -> bool:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> CAP_SYS_PTRACE & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


@functools.lru_cache(maxsize=1)
def cma_permitted() -> tuple[bool, str]:
    """(ok, why not): can a same-user sibling process write into our memory with
    process_vm_writev? Needs the call itself (vm_works) and a Yama ptrace_scope of 0, or 1-2 with
    CAP_SYS_PTRACE (scope 1 only lets a process trace its own descendants)."""
    if not vm_works():
        return False, "process_vm_writev is forbidden here (seccomp?)"
    scope = _yama_scope()
    if scope is None or scope == 0 or (scope < 3 and _has_cap_ptrace()):
        return True, ""
    return False, (f"{YAMA_SCOPE} is {scope}: sibling processes may not write into each other "
                   f"(set it to 0, or grant CAP_SYS_PTRACE)")
