"""Hosts simulated on one machine: one network namespace per host, joined by links that can be
cut (#49 item 4: faults between hosts; needs root and `ip`, no netem, no iptables).

`NetLab(["r", "p", "d0"], [("r", "p"), ("r", "d0"), ("p", "d0")])` builds, for each node, a
namespace `pdsf-<tag>-<node>` with loopback up and one host address (`addr(node)`, 10.251.9.N on
its loopback), and for each link a bridge in the root namespace with a veth pair to each side
(a /30 per side pair, 10.251.L.0/30). Each namespace routes the other end's host address over
that link, from its own host address: a node reaches only the nodes it has a link to, and
every connection carries the host addresses at both ends (what a server advertises is what its
peers reach it at).

A cut (`cut(a, b)`, `isolate(node)`) sets the link's bridge down: both ends keep their carrier,
their routes and their established connections, and every frame between them is dropped, as
when a switch between two hosts fails (new connections time out at ARP, ~3 s, not refused at
once). `heal` / `rejoin` set it up again.

`enter(node)` moves the calling thread (and the threads and processes it starts afterwards)
into the node's namespace (setns(2) through libc: os.setns is Python 3.12+); the lab's own `ip`
commands still run in the namespace this module was imported in.

Everything is named `pdsf-<tag>...` and removed at `close()` (a context manager; the build
removes what it made when a step fails); `sweep()` removes whatever a killed run left behind.
Only these namespaces and their 10.251.0.0/16 addresses are ever targeted.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import shutil
import subprocess
from collections.abc import Sequence

PREFIX = "pdsf-"
CLONE_NEWNET = 0x40000000
HOST_NET = "10.251.9"


def available() -> tuple[bool, str]:
    """(True, "") when this process can build a lab, else (False, why)."""
    if os.geteuid() != 0:
        return False, "network namespaces need root"
    if shutil.which("ip") is None:
        return False, "the `ip` command (iproute2) is not installed"
    return True, ""


# the namespace this module was imported in (the root one, where the bridges live): `ip`
# commands on bridges run there even from a thread that entered a node's namespace
_ROOT_NS = os.open("/proc/self/ns/net", os.O_RDONLY) if os.path.exists("/proc/self/ns/net") \
    else -1


def _setns(fd: int, what: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns into {what}: {os.strerror(err)}")


def _in_root() -> None:  # preexec_fn of the `ip` commands
    _setns(_ROOT_NS, "the root network namespace")


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=30,
                          preexec_fn=_in_root if _ROOT_NS >= 0 else None)  # noqa: PLW1509


def _ip(*args: str, ns: str | None = None) -> None:
    argv = ["ip", *(["-n", ns] if ns else []), *args]
    done = _run(argv)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")


def sweep(tag: str = "") -> list[str]:
    """Remove every namespace and link named `pdsf-<tag>` (all of pdsf-* when no tag); what
    it removed."""
    gone = []
    pre = PREFIX + tag
    for ns in [n for n in _run(["ip", "netns", "list"]).stdout.split() if n.startswith(pre)]:
        _run(["ip", "netns", "del", ns])
        gone.append(ns)
    for line in _run(["ip", "-o", "link", "show"]).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        if name.startswith(pre):
            _run(["ip", "link", "del", name])
            gone.append(name)
    return gone


class NetLab:
    def __init__(self, nodes: Sequence[str], links: Sequence[tuple[str, str]],
                 tag: str | None = None) -> None:
        if len(nodes) > 200 or len(links) > 90:
            raise ValueError("at most 200 nodes and 90 links")
        self.tag = tag or secrets.token_hex(2)
        self.nodes, self.links = list(nodes), [tuple(sorted(link)) for link in links]
        for a, b in self.links:
            if a not in self.nodes or b not in self.nodes:
                raise ValueError(f"link {a}-{b} names a node that is not in {self.nodes}")
        self._built = False
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        self._built = True

    # -- names -------------------------------------------------------------------------------
    def ns(self, node: str) -> str:
        return f"{PREFIX}{self.tag}-{node}"

    def addr(self, node: str) -> str:
        return f"{HOST_NET}.{self.nodes.index(node) + 1}"

    def _bridge(self, i: int) -> str:
        return f"{PREFIX}{self.tag}b{i}"

    def _link_of(self, a: str, b: str) -> int:
        return self.links.index(tuple(sorted((a, b))))

    def exec_argv(self, node: str, argv: Sequence[str]) -> list[str]:
        """`argv` run inside `node`'s namespace."""
        return ["ip", "netns", "exec", self.ns(node), *argv]

    # -- build and tear down -----------------------------------------------------------------
    def _build(self) -> None:
        for node in self.nodes:
            _ip("netns", "add", self.ns(node))
            _ip("link", "set", "lo", "up", ns=self.ns(node))
            _ip("addr", "add", f"{self.addr(node)}/32", "dev", "lo", ns=self.ns(node))
        for i, (a, b) in enumerate(self.links):
            net = f"10.251.{100 + i}"
            br = self._bridge(i)
            _ip("link", "add", br, "type", "bridge")
            _ip("link", "set", br, "up")
            for side, node, mine, theirs in ((0, a, 1, 2), (1, b, 2, 1)):
                outer = f"{PREFIX}{self.tag}{i}{'ab'[side]}"
                inner = outer + "n"  # its name inside the namespace, as in the root one
                _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
                _ip("link", "set", outer, "master", br)
                _ip("link", "set", outer, "up")
                _ip("link", "set", inner, "netns", self.ns(node))
                ns = self.ns(node)
                _ip("addr", "add", f"{net}.{mine}/30", "dev", inner, ns=ns)
                _ip("link", "set", inner, "up", ns=ns)
                other = b if node == a else a
                _ip("route", "add", f"{self.addr(other)}/32", "via", f"{net}.{theirs}",
                    "src", self.addr(node), ns=ns)

    def close(self) -> None:
        """Remove every namespace and link of this lab (idempotent; processes still running
        inside a namespace keep it alive until they exit: stop them first)."""
        sweep(self.tag)

    def __enter__(self) -> NetLab:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    # -- faults ------------------------------------------------------------------------------
    def cut(self, a: str, b: str) -> None:
        _ip("link", "set", self._bridge(self._link_of(a, b)), "down")

    def heal(self, a: str, b: str) -> None:
        _ip("link", "set", self._bridge(self._link_of(a, b)), "up")

    def neighbours(self, node: str) -> list[str]:
        return [b if a == node else a for a, b in self.links if node in (a, b)]

    def isolate(self, node: str) -> None:
        for other in self.neighbours(node):
            self.cut(node, other)

    def rejoin(self, node: str) -> None:
        for other in self.neighbours(node):
            self.heal(node, other)

    # -- this process ------------------------------------------------------------------------
    def enter(self, node: str) -> None:
        """Move the calling thread into `node`'s namespace."""
        fd = os.open(f"/var/run/netns/{self.ns(node)}", os.O_RDONLY)
        try:
            _setns(fd, self.ns(node))
        finally:
            os.close(fd)
