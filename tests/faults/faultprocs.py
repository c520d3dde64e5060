"""What a server's process group holds, read from /proc: its live processes and the TCP ports
they listen on. The fault tests use it to check that nothing outlives a killed server, and
`frozen()` to stop a group for a while."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator


def _pgid_of(pid: str) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] == "Z":  # a zombie holds nothing; its parent reaps it
        return None
    return int(fields[2])


def group_pids(pgid: int) -> list[int]:
    """Live (non-zombie) processes of the process group."""
    return [int(p) for p in filter(str.isdigit, os.listdir("/proc")) if _pgid_of(p) == pgid]


def group_listening_ports(pgid: int) -> set[int]:
    """TCP ports listened on by any process of the group (server, scheduler, ranks)."""
    inodes: set[str] = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if _pgid_of(pid) != pgid:
            continue
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
        except OSError:
            continue
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in list(f)[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # LISTEN
                    ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return ports


def listening_ports() -> set[int]:
    """Every TCP port in LISTEN state on this host's network namespace."""
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in list(f)[1:]:
                cols = line.split()
                if cols[3] == "0A":
                    ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return ports


def wait_group_gone(pgid: int, ports: set[int], timeout: float) -> float:
    """Seconds until no process of the group lives and none of `ports` listens (asserts)."""
    t0 = time.monotonic()
    while group_pids(pgid) or ports & listening_ports():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(
                f"after {timeout}s the killed server left processes {group_pids(pgid)} and "
                f"listening ports {sorted(ports & listening_ports())}")
        time.sleep(0.05)
    return time.monotonic() - t0


@contextlib.contextmanager
def frozen(pgid: int) -> Iterator[None]:
    """The process group stopped (SIGSTOP) for the block, and continued however it ends."""
    os.killpg(pgid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.killpg(pgid, signal.SIGCONT)
