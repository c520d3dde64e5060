"""Machinery of bench/transfer.py: the KV layout, workloads, and the measured cases.

- `HostKV` / `PoolKV`: the SmolLM2-135M KV pool (per layer a K and a V buffer) in ordinary
  numpy memory, or from a pdserve memory pool (`torch`, `thp`, `shm`) as a server holds it;
- `EngineCase`: a TransferEngine here writing into the same engine class in a spawned peer
  process that owns the destination pool; each side's pool is the one a server running that
  backend allocates (the vendor cases keep numpy memory, shared with their direct-API
  baselines);
  one transfer = write(planned batch) + wait() until DONE, as the core's sender does; verify()
  compares pages byte for byte;
- `RawSocketCase` / `MemcpyCase`: the limits (one contiguous sendall to another process, one
  single-threaded memcpy) for the same number of bytes.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import random
import socket
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection

import numpy as np

from pdcore.builtin.planner import DefaultPlanner
from pdcore.interfaces.planner import KVLayout
from pdcore.interfaces.transfer import (
    BackendContext,
    CopyBatch,
    MemoryRegion,
    TransferEngine,
    TransferStatus,
)
from pdcore.plugins.lazy import load

WAIT_S = 120.0  # bound of one transfer's wait
# SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64; float32 on CPU; page_size 16.
MODEL = {"num_layers": 30, "kv_heads": 3, "head_dim": 64, "elem_size": 4, "page_size": 16}


# -- layout and workloads ----------------------------------------------------------------------
@dataclass
class Workload:
    name: str
    tokens: int
    src_pages: np.ndarray
    dst_pages: np.ndarray
    copies: int = 0  # descriptors after page-run coalescing


def layout(k_bases: list[int], v_bases: list[int], pool_pages: int) -> KVLayout:
    return KVLayout(k_bases=tuple(k_bases), v_bases=tuple(v_bases), num_pages=pool_pages,
                    dtype="float32", **MODEL)


def item_len() -> int:
    return MODEL["page_size"] * MODEL["kv_heads"] * MODEL["head_dim"] * MODEL["elem_size"]


def workloads(pool_pages: int, prompts: list[int], seed: int) -> list[Workload]:
    rng = np.random.default_rng(seed)
    out = []
    for tokens in prompts:
        n = -(-tokens // MODEL["page_size"])
        if n > pool_pages:
            raise SystemExit(f"--pool-pages {pool_pages} cannot hold a {tokens}-token prompt")
        out.append(Workload(f"{tokens}_tokens", tokens, rng.choice(pool_pages, n, replace=False),
                            rng.choice(pool_pages, n, replace=False)))
    return out


class KV:
    """Per layer a K and a V buffer of `pool_pages` pages; `regions` in that order."""

    regions: list[MemoryRegion]

    def bases(self) -> tuple[list[int], list[int]]:
        n = MODEL["num_layers"]
        return [r.addr for r in self.regions[:n]], [r.addr for r in self.regions[n:]]

    def page(self, buffer: int, page: int) -> bytes:
        raise NotImplementedError

    def close(self) -> None:
        pass


def _content(buffer: int, size: int) -> np.ndarray:
    """Distinct, cheap bytes of one source buffer (uint64 counters), so verify() sees misplaced
    pages."""
    return np.arange(buffer << 40, (buffer << 40) + size // 8, dtype=np.uint64)


class HostKV(KV):
    """The pool in ordinary process memory (numpy), pre-touched."""

    def __init__(self, pool_pages: int, fill: bool) -> None:
        size = pool_pages * item_len()
        self.arrays = [np.zeros(size, dtype=np.uint8) for _ in range(2 * MODEL["num_layers"])]
        for i, a in enumerate(self.arrays):
            # distinct content (fill) or zeros written once so every page is resident
            a.view(np.uint64)[:] = _content(i, size) if fill else 0
        self.regions = [MemoryRegion(a.ctypes.data, a.nbytes, name=f"kv{i}")
                        for i, a in enumerate(self.arrays)]

    def page(self, buffer: int, page: int) -> bytes:
        il = item_len()
        return self.arrays[buffer][page * il:(page + 1) * il].tobytes()


class PoolKV(KV):
    """The pool allocated from a pdserve memory pool (`torch`, `thp`, `shm`, ...), as a server
    started with that pool holds its KV; every page resident."""

    def __init__(self, kind: str, pool_pages: int, fill: bool, server_id: str) -> None:
        import torch

        from pdcore.interfaces.memory import PoolContext
        from pdcore.plugins.host import memory_pools

        self.pool = memory_pools().create(kind, PoolContext(server_id=server_id))
        size = pool_pages * item_len()
        self.bufs = [self.pool.allocate(f"kv{i}", (size,), torch.uint8)
                     for i in range(2 * MODEL["num_layers"])]
        for i, b in enumerate(self.bufs):
            if fill:
                b.tensor.numpy().view(np.uint64)[:] = _content(i, size)
            else:
                b.tensor.fill_(1)  # resident, as in a warmed-up server
        self.regions = [b.region for b in self.bufs]

    def page(self, buffer: int, page: int) -> bytes:
        il = item_len()
        return self.bufs[buffer].tensor[page * il:(page + 1) * il].numpy().tobytes()

    def close(self) -> None:
        self.pool.close()


# -- peer process of the engine cases ----------------------------------------------------------
def _peer_main(conn: Connection, engine_path: str, pool_kind: str, pool_pages: int,
               env: dict[str, str]) -> None:
    kv: KV | None = None
    try:
        server_id = f"bench-{uuid.uuid4().hex[:8]}"
        kv = HostKV(pool_pages, fill=False) if pool_kind == "host" else \
            PoolKV(pool_kind, pool_pages, fill=False, server_id=server_id)
        regions, page = kv.regions, kv.page
        engine: TransferEngine = load(engine_path)(
            BackendContext(role="decode", server_id=server_id, env=env))
        engine.register(regions)
        conn.send(("ready", engine.endpoint(), [r.to_dict() for r in regions]))
    except BaseException:  # noqa: BLE001 - any start-up failure goes back to the parent
        conn.send(("error", traceback.format_exc()))
        if kv is not None:
            kv.close()
        return
    while True:
        try:
            cmd = conn.recv()
        except (EOFError, OSError):
            break
        if cmd[0] == "pages":
            conn.send([page(b, p) for b, p in cmd[1]])
        else:
            break
    engine.close()
    kv.close()


def _spawn(target: Callable, *args: object) -> tuple[multiprocessing.Process, Connection]:
    mp = multiprocessing.get_context("spawn")
    parent, child = mp.Pipe()
    proc = mp.Process(target=target, args=(child, *args), daemon=True)
    proc.start()
    child.close()
    if not parent.poll(180):
        proc.kill()
        raise RuntimeError(f"{target.__name__} did not start within 180 s")
    return proc, parent


# -- cases -------------------------------------------------------------------------------------
class Case:
    """One thing being measured. run() returns the seconds one transfer of `w` took."""

    name = ""
    def run(self, w: Workload) -> float:
        raise NotImplementedError

    def verify(self, w: Workload) -> None:  # only data-moving engine cases check bytes
        pass

    def close(self) -> None:
        pass


class EngineCase(Case):
    """A transfer engine in this process writing into the same engine in a peer process."""

    def __init__(self, name: str, engine_path: str, pool_kind: str, src: KV | str,
                 pool_pages: int, env: dict[str, str] | None = None) -> None:
        """`pool_kind`: the peer's pool (`host` or a pdserve memory pool); `src`: the pool this
        side reads from, or the name of a pdserve memory pool to allocate it from (owned and
        closed by this case)."""
        self.name, self.pool_pages = name, pool_pages
        self._own_src = isinstance(src, str)
        self.pools = {"src": src if self._own_src else "host", "dst": pool_kind}
        self.src: KV = PoolKV(src, pool_pages, fill=True, server_id=f"bench-{name}-src") \
            if self._own_src else src
        env = dict(env or {})
        try:
            self.proc, self.conn = _spawn(_peer_main, engine_path, pool_kind, pool_pages, env)
            msg = self.conn.recv()
            if msg[0] != "ready":
                raise RuntimeError(f"{name} peer failed:\n{msg[1]}")
        except BaseException:
            if self._own_src:
                self.src.close()
            raise
        regions = [MemoryRegion.from_dict(d) for d in msg[2]]
        self.engine: TransferEngine = load(engine_path)(
            BackendContext(role="prefill", server_id=f"bench-{name}", env=env))
        self.engine.register(self.src.regions)
        self.peer = self.engine.connect(msg[1], regions)
        n = MODEL["num_layers"]
        self.src_layout = layout(*self.src.bases(), pool_pages)
        self.dst_layout = layout([r.addr for r in regions[:n]], [r.addr for r in regions[n:]],
                                 pool_pages)
        self._batches: dict[str, CopyBatch] = {}

    def batch(self, w: Workload) -> CopyBatch:
        if w.name not in self._batches:
            self._batches[w.name] = DefaultPlanner().plan(self.src_layout, self.dst_layout,
                                                          w.src_pages, w.dst_pages)
        return self._batches[w.name]

    def run(self, w: Workload) -> float:
        b = self.batch(w)
        t0 = time.perf_counter()
        r = self.engine.wait(self.engine.write(self.peer, b), WAIT_S)  # as the core's sender
        dt = time.perf_counter() - t0
        if r.status is not TransferStatus.DONE:
            raise RuntimeError(f"{self.name}: transfer failed: {r.reason}")
        return dt

    def verify(self, w: Workload) -> None:
        rng = random.Random(0)
        picks = [(rng.randrange(2 * MODEL["num_layers"]), rng.randrange(len(w.src_pages)))
                 for _ in range(16)]
        self.conn.send(("pages", [(b, int(w.dst_pages[i])) for b, i in picks]))
        got = self.conn.recv()
        for (b, i), data in zip(picks, got):
            if data != self.src.page(b, int(w.src_pages[i])):
                raise RuntimeError(f"{self.name}: page {i} of buffer {b} arrived wrong")

    def close(self) -> None:
        self.engine.close()
        try:
            self.conn.send(("stop",))
        except OSError:
            pass
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
        if self._own_src:
            self.src.close()


def _raw_peer_main(conn: Connection, nbytes: int) -> None:
    from pdcore.builtin.tcp_wire import tune

    buf = np.ones(nbytes, dtype=np.uint8)  # resident, like the engines' pools
    view = memoryview(buf)
    srv = socket.create_server(("127.0.0.1", 0))
    conn.send(("ready", srv.getsockname()[1]))
    c, _ = srv.accept()
    tune(c)
    head = bytearray(16)
    while True:
        if c.recv_into(head, 16, socket.MSG_WAITALL) != 16:
            break
        at, n = int.from_bytes(head[:8], "little"), int.from_bytes(head[8:], "little")
        got = 0
        while got < n:
            k = c.recv_into(view[at + got:at + n])
            if not k:
                return
            got += k
        c.sendall(b"k")


class _Regions:
    """Each workload's own bytes in a limit case's buffers (disjoint, allocated on first use):
    a workload's bytes are then as cold as an engine case's pages are. Sharing a prefix would
    let the small workload find its bytes in cache after the big one touched them."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._at: dict[str, int] = {}
        self._next = 0

    def offset(self, w: Workload) -> int:
        if w.name not in self._at:
            n = workload_bytes(w)
            if self._next + n > self.nbytes:
                raise ValueError(f"{self.nbytes}-byte buffers cannot hold workload {w.name}")
            self._at[w.name], self._next = self._next, self._next + n
        return self._at[w.name]


class RawSocketCase(Case):
    """The loopback limit: the same bytes as one contiguous sendall to another process."""

    name = "raw_socket"

    def __init__(self, nbytes: int) -> None:
        from pdcore.builtin.tcp_wire import tune

        self.buf = np.ones(nbytes, dtype=np.uint8)
        self.regions = _Regions(nbytes)
        self.proc, conn = _spawn(_raw_peer_main, nbytes)
        _, port = conn.recv()
        self.conn = conn
        self.sock = socket.create_connection(("127.0.0.1", port))
        tune(self.sock)

    def run(self, w: Workload) -> float:
        n, at = workload_bytes(w), self.regions.offset(w)
        t0 = time.perf_counter()
        self.sock.sendall(at.to_bytes(8, "little") + n.to_bytes(8, "little"))
        self.sock.sendall(memoryview(self.buf)[at:at + n])
        if self.sock.recv(1) != b"k":
            raise RuntimeError("raw socket peer went away")
        return time.perf_counter() - t0

    def close(self) -> None:
        self.sock.close()
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


class MemcpyCase(Case):
    """The memory limit: one single-threaded memcpy of the same bytes, contiguous."""

    name = "memcpy"

    def __init__(self, nbytes: int) -> None:
        self.a = np.ones(nbytes, dtype=np.uint8)
        self.b = np.ones(nbytes, dtype=np.uint8)
        self.regions = _Regions(nbytes)

    def run(self, w: Workload) -> float:
        n, at = workload_bytes(w), self.regions.offset(w)
        t0 = time.perf_counter()
        ctypes.memmove(self.b.ctypes.data + at, self.a.ctypes.data + at, n)
        return time.perf_counter() - t0


def workload_bytes(w: Workload) -> int:
    return len(w.src_pages) * item_len() * 2 * MODEL["num_layers"]


@dataclass
class Env:
    src: HostKV  # numpy source of the layout and the vendor cases
    pool_pages: int
    baseline_bytes: int  # the limit cases' buffers: every workload's bytes, side by side


