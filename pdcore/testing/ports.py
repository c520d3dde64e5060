"""Loopback ports for servers a test starts later, never handed to two live processes at once.

A port is taken below the kernel's ephemeral range: a port from bind(0) comes from that range,
and between the check here and the server's bind the kernel may give it to any outgoing
connection (a 2P2D test once lost its bootstrap port that way).

Checking that a port binds is not enough when several test processes pick at the same time
(pytest-xdist workers, CI's matrix entries running side by side, another user's tests on the
same machine): two of them can both find a port free before either server binds it. So each
port handed out is claimed in a directory shared by every process of this user (PDSERVE_PORT_DIR,
default <tmp>/pdserve-ports-<uid>): a file named after the port holds the claimer's pid, written
under an exclusive lock on that directory's lock file. A claim holds while its process lives (a
test restarts a killed server on the same ports); the claim of a process that is gone is taken
over, so nothing needs cleaning up.
"""

from __future__ import annotations

import fcntl
import os
import random
import socket
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pdcore.env import ENV, Env

LOWEST_PORT = 20000
DIR_ENV = Env.pdserve_port_dir.name
_PORTS_GIVEN: set[int] = set()  # this process's claims (also where claims cannot be written)
_PORTS_LOCK = threading.Lock()  # the flock is per open file, not per thread


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def claim_dir() -> Path:
    raw = ENV.pdserve_port_dir
    return Path(raw) if raw else Path(tempfile.gettempdir()) / f"pdserve-ports-{os.getuid()}"


@contextmanager
def _claims_locked() -> Iterator[Path | None]:
    """The claim directory under its exclusive lock; None where it cannot be made (then only
    this process's own record keeps ports apart)."""
    d = claim_dir()
    try:
        d.mkdir(parents=True, exist_ok=True)
        fd = os.open(d / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        yield None
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield d
    finally:
        os.close(fd)  # releases the lock


def _claimed(d: Path | None, port: int) -> bool:
    """A live process (this one included) holds a claim on `port`."""
    if d is None:
        return False
    try:
        pid = int((d / str(port)).read_text() or 0)
    except (OSError, ValueError):
        return False
    if pid <= 0:
        return False
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False  # its process is gone: the claim is stale
    except PermissionError:
        pass  # alive, another user's process
    return True


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1", offsets: tuple[int, ...] = (0,)) -> int:
    """A port P nothing listens on now, for a server started later, with P + each of `offsets`
    free too (all of them claimed: `pdserve up` puts decode at its base + 100, a DP node's zmq
    links at its init port + 1 and + 2). Never the same port twice while its claimer lives."""
    low = _ephemeral_low()
    top = max(offsets)
    with _PORTS_LOCK, _claims_locked() as d:
        for _ in range(400 if low > LOWEST_PORT + 1000 + top else 0):
            base = random.randrange(LOWEST_PORT, low - top)
            ports = [base + o for o in offsets]
            if any(p in _PORTS_GIVEN or _claimed(d, p) or not _bindable(host, p)
                   for p in ports):
                continue
            for p in ports:
                _PORTS_GIVEN.add(p)
                if d is not None:
                    try:
                        (d / str(p)).write_text(str(os.getpid()))
                    except OSError:
                        pass
            return base
    if offsets != (0,):
        raise RuntimeError(f"no free ports at offsets {offsets} below {low}")
    with socket.socket() as s:  # no room below the ephemeral range: the kernel's pick
        s.bind((host, 0))
        port = int(s.getsockname()[1])
    _PORTS_GIVEN.add(port)
    return port
