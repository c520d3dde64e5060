"""Named POSIX shared-memory segments of pdserve: naming, create/map, liveness, clean-up.

Segments are files under /dev/shm named `pdserve_{server_id}_{pid}_{label}`. They are created
with os.open + mmap directly (not multiprocessing.shared_memory), so Python's resource tracker
never unlinks or warns about them behind our back. The owner pid in the name lets any later
process remove the segments of a server that died without cleaning up.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import re
import shutil
import socket
from dataclasses import dataclass

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
PREFIX = "pdserve_"
HOST_ID_ENV = "PDCORE_HOST_ID"
PAGE = mmap.PAGESIZE
_UNSAFE = re.compile(r"[^A-Za-z0-9.-]")


def clean_part(text: str) -> str:
    """A name part without '_' (the field separator) or characters a file name cannot hold."""
    return _UNSAFE.sub("-", text)[:80] or "x"


def segment_name(server_id: str, pid: int, label: str) -> str:
    return f"{PREFIX}{clean_part(server_id)}_{pid}_{clean_part(label)}"


def owner_pid(name: str) -> int | None:
    parts = name.split("_", 3)
    if len(parts) != 4 or parts[0] + "_" != PREFIX or not parts[2].isdigit():
        return None
    return int(parts[2])


def path_of(name: str) -> str:
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"invalid shared-memory segment name {name!r}")
    return os.path.join(SHM_DIR, name)


def round_up(n: int, to: int = PAGE) -> int:
    return max(to, (n + to - 1) // to * to)


def pid_alive(pid: int) -> bool:
    """True while pid runs (a zombie counts as dead: it will never touch memory again)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return stat[stat.rindex(b")") + 2 : stat.rindex(b")") + 3] != b"Z"
    except (OSError, ValueError):
        return True


def pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def host_identity(env: dict | None = None) -> str:
    """Who shares /dev/shm with us: hostname + boot id; PDCORE_HOST_ID overrides (tests)."""
    override = (env or {}).get(HOST_ID_ENV)
    if override:
        return str(override)
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "no-boot-id"
    return f"{socket.gethostname()}/{boot}"


def address_of(mm: mmap.mmap) -> int:
    """Base address of a mapping, without keeping a buffer export alive (so close() works)."""
    probe = ctypes.c_char.from_buffer(mm)
    addr = ctypes.addressof(probe)
    del probe
    return addr


class NoSpace(OSError):
    """/dev/shm cannot hold the segment."""


def create(name: str, size: int) -> mmap.mmap:
    """A new zero-filled segment of `size` bytes (a multiple of the page size), mapped.

    The space is reserved now (posix_fallocate): tmpfs otherwise hands out pages on first touch,
    and a full /dev/shm would then kill the process (or a peer writing into it) with SIGBUS.
    """
    fd = os.open(path_of(name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
                free = shutil.disk_usage(SHM_DIR).free
                raise NoSpace(e.errno, f"{SHM_DIR} has {free / 2**20:.0f} MiB free, segment "
                                       f"{name} needs {size / 2**20:.0f} MiB") from None
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
        return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        unlink(name)
        raise
    finally:
        os.close(fd)  # the mapping keeps the segment alive on its own


@dataclass(frozen=True, slots=True)
class Mapped:
    """A peer's segment mapped here. `inode` tells whether the name still points at it."""

    name: str
    mm: mmap.mmap
    addr: int
    size: int
    inode: tuple[int, int]


def map_existing(name: str) -> Mapped:
    fd = os.open(path_of(name), os.O_RDWR)
    try:
        st = os.fstat(fd)
        if st.st_size == 0:
            raise ValueError(f"shared-memory segment {name!r} is empty")
        mm = mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    return Mapped(name, mm, address_of(mm), st.st_size, (st.st_dev, st.st_ino))


def still_there(m: Mapped) -> bool:
    try:
        st = os.stat(path_of(m.name))
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == m.inode


def unlink(name: str) -> bool:
    try:
        os.unlink(path_of(name))
        return True
    except FileNotFoundError:
        return False


def clean_stale() -> list[str]:
    """Remove pdserve segments whose owner process is gone. Returns the names removed.

    Limitation: processes in another pid namespace that share this /dev/shm are not visible;
    their segments look stale. Run such servers with a private /dev/shm (the container default).
    """
    me = os.getpid()
    removed = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    for name in names:
        pid = owner_pid(name)
        if pid is None or pid == me or pid_alive(pid):
            continue
        try:
            if unlink(name):
                removed.append(name)
        except OSError as e:
            log.warning("could not remove stale shared-memory segment %s: %s", name, e)
    if removed:
        log.info("removed %d stale shared-memory segment(s) of dead processes: %s",
                 len(removed), ", ".join(removed[:8]) + (" ..." if len(removed) > 8 else ""))
    return removed
