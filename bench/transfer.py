"""KV transfer bandwidth per backend on SmolLM2-135M's page layout, against the limits of this
machine measured in the same run.

Lifecycle:
1. layout: 30 layers x (K, V) buffers of [pool_pages, 16, 3, 64] float32 (item_len 12 KiB);
   workloads: a 512- and a 4096-token prompt, pages scattered at random in both pools, planned
   by the core's DefaultPlanner (page runs consecutive on both sides are coalesced);
2. every case in CASES starts (each owns its peer process): raw loopback socket, the tcp backend,
   single-threaded memcpy, the shm backend (other plugins add theirs to CASES);
3. repetitions alternate between cases (shuffled order per repetition), after one warm-up
   repetition whose destination bytes are verified;
4. median seconds -> GB/s, the RATIOS against their targets; bench/results/transfer.json and
   bench/results/transfer.png.

Run: `python bench/transfer.py [--reps 7] [--cases raw_socket,tcp,memcpy,shm]`.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing
import os
import platform
import random
import socket
import statistics
import sys
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

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

POLL_S = float(os.environ.get("BENCH_POLL_S", "2e-4"))  # poll period of run(), as a core loop
RESULTS = Path(__file__).resolve().parent / "results"

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


class HostKV:
    """Per layer a K and a V buffer in ordinary process memory (numpy), pre-touched."""

    def __init__(self, pool_pages: int, fill: bool) -> None:
        size = pool_pages * item_len()
        self.arrays = [np.zeros(size, dtype=np.uint8) for _ in range(2 * MODEL["num_layers"])]
        for i, a in enumerate(self.arrays):
            # distinct, cheap content (fill) or zeros written once so every page is resident
            a.view(np.uint64)[:] = np.arange(i << 40, (i << 40) + size // 8, dtype=np.uint64) \
                if fill else 0
        self.regions = [MemoryRegion(a.ctypes.data, a.nbytes, name=f"kv{i}")
                        for i, a in enumerate(self.arrays)]

    def bases(self) -> tuple[list[int], list[int]]:
        n = MODEL["num_layers"]
        return [r.addr for r in self.regions[:n]], [r.addr for r in self.regions[n:]]

    def page(self, buffer: int, page: int) -> bytes:
        il = item_len()
        return self.arrays[buffer][page * il:(page + 1) * il].tobytes()


# -- peer process of the engine cases ----------------------------------------------------------
def _peer_main(conn: Connection, engine_path: str, pool_kind: str, pool_pages: int,
               env: dict[str, str]) -> None:
    try:
        server_id = f"bench-{uuid.uuid4().hex[:8]}"
        pool = None
        if pool_kind == "shm":
            import torch

            from pdcore.builtin.shm_pool import ShmMemoryPool
            from pdcore.interfaces.memory import PoolContext

            pool = ShmMemoryPool(PoolContext(server_id=server_id))
            bufs = [pool.allocate(f"kv{i}", (pool_pages * item_len(),), torch.uint8)
                    for i in range(2 * MODEL["num_layers"])]
            for b in bufs:
                b.tensor.fill_(1)  # make every page resident, as in a warmed-up server
            regions = [b.region for b in bufs]

            def page(buffer: int, p: int) -> bytes:
                il = item_len()
                return bufs[buffer].tensor[p * il:(p + 1) * il].numpy().tobytes()
        else:
            kv = HostKV(pool_pages, fill=False)
            regions, page = kv.regions, kv.page
        engine: TransferEngine = load(engine_path)(
            BackendContext(role="decode", server_id=server_id, env=env))
        engine.register(regions)
        conn.send(("ready", engine.endpoint(), [r.to_dict() for r in regions]))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
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
    if pool is not None:
        pool.close()


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
    verifiable = False

    def run(self, w: Workload) -> float:
        raise NotImplementedError

    def verify(self, w: Workload) -> None:  # noqa: B027 - only data-moving engine cases check
        pass

    def close(self) -> None:  # noqa: B027
        pass


class EngineCase(Case):
    """A transfer engine in this process writing into the same engine in a peer process."""

    verifiable = True

    def __init__(self, name: str, engine_path: str, pool_kind: str, src: HostKV,
                 pool_pages: int, env: dict[str, str] | None = None) -> None:
        self.name, self.src, self.pool_pages = name, src, pool_pages
        env = dict(env or {})
        self.proc, self.conn = _spawn(_peer_main, engine_path, pool_kind, pool_pages, env)
        msg = self.conn.recv()
        if msg[0] != "ready":
            raise RuntimeError(f"{name} peer failed:\n{msg[1]}")
        regions = [MemoryRegion.from_dict(d) for d in msg[2]]
        self.engine: TransferEngine = load(engine_path)(
            BackendContext(role="prefill", server_id=f"bench-{name}", env=env))
        self.engine.register(src.regions)
        self.peer = self.engine.connect(msg[1], regions)
        n = MODEL["num_layers"]
        self.src_layout = layout(*src.bases(), pool_pages)
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
        h = self.engine.write(self.peer, b)
        while (r := self.engine.poll(h)).status is TransferStatus.PENDING:
            time.sleep(POLL_S)
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


def _raw_peer_main(conn: Connection, nbytes: int) -> None:
    from pdcore.builtin.tcp_wire import tune

    buf = np.ones(nbytes, dtype=np.uint8)  # resident, like the engines' pools
    view = memoryview(buf)
    srv = socket.create_server(("127.0.0.1", 0))
    conn.send(("ready", srv.getsockname()[1]))
    c, _ = srv.accept()
    tune(c)
    head = bytearray(8)
    while True:
        if c.recv_into(head, 8, socket.MSG_WAITALL) != 8:
            break
        n, got = int.from_bytes(head, "little"), 0
        while got < n:
            k = c.recv_into(view[got:n])
            if not k:
                return
            got += k
        c.sendall(b"k")


class RawSocketCase(Case):
    """The loopback limit: the same bytes as one contiguous sendall to another process."""

    name = "raw_socket"

    def __init__(self, max_bytes: int) -> None:
        from pdcore.builtin.tcp_wire import tune

        self.buf = np.ones(max_bytes, dtype=np.uint8)
        self.proc, conn = _spawn(_raw_peer_main, max_bytes)
        _, port = conn.recv()
        self.conn = conn
        self.sock = socket.create_connection(("127.0.0.1", port))
        tune(self.sock)

    def run(self, w: Workload) -> float:
        n = workload_bytes(w)
        t0 = time.perf_counter()
        self.sock.sendall(n.to_bytes(8, "little"))
        self.sock.sendall(memoryview(self.buf)[:n])
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

    def __init__(self, max_bytes: int) -> None:
        self.a = np.ones(max_bytes, dtype=np.uint8)
        self.b = np.ones(max_bytes, dtype=np.uint8)

    def run(self, w: Workload) -> float:
        n = workload_bytes(w)
        t0 = time.perf_counter()
        ctypes.memmove(self.b.ctypes.data, self.a.ctypes.data, n)
        return time.perf_counter() - t0


def workload_bytes(w: Workload) -> int:
    return len(w.src_pages) * item_len() * 2 * MODEL["num_layers"]


@dataclass
class Env:
    src: HostKV
    pool_pages: int
    max_bytes: int


def bench_raw_socket(env: Env) -> Case:
    return RawSocketCase(env.max_bytes)


def bench_memcpy(env: Env) -> Case:
    return MemcpyCase(env.max_bytes)


def bench_tcp(env: Env) -> Case:
    return EngineCase("tcp", "pdcore.builtin.tcp_backend:TcpTransferEngine", "host", env.src,
                      env.pool_pages)


def bench_shm(env: Env) -> Case:
    return EngineCase("shm", "pdcore.builtin.shm_backend:ShmTransferEngine", "shm", env.src,
                      env.pool_pages)


def bench_shm_vm(env: Env) -> Case:
    """shm with PDCORE_SHM_COPY=vm (process_vm_writev batches); not run by default."""
    return EngineCase("shm_vm", "pdcore.builtin.shm_backend:ShmTransferEngine", "shm",
                      env.src, env.pool_pages, env={"PDCORE_SHM_COPY": "vm"})


# name -> factory. Other backends add one function each (e.g. "mooncake": bench_mooncake).
CASES: dict[str, Callable[[Env], Case]] = {
    "raw_socket": bench_raw_socket,
    "tcp": bench_tcp,
    "memcpy": bench_memcpy,
    "shm": bench_shm,
    "shm_vm": bench_shm_vm,
}
DEFAULT_CASES = ["raw_socket", "tcp", "memcpy", "shm"]
# (case, baseline, target ratio): printed and stored for every pair whose cases both ran.
RATIOS: list[tuple[str, str, float]] = [
    ("tcp", "raw_socket", 0.70),
    ("shm", "memcpy", 0.50),
    ("shm", "tcp", 3.0),
]


# -- driver ------------------------------------------------------------------------------------
def measure(cases: dict[str, Case], loads: list[Workload], reps: int) -> dict:
    times: dict[str, dict[str, list[float]]] = {w.name: {c: [] for c in cases} for w in loads}
    order = list(cases)
    rng = random.Random(1)
    for w in loads:  # warm-up: first touches, connections, page tables; then check the bytes
        for c in order:
            cases[c].run(w)
            cases[c].verify(w)
    for _ in range(reps):
        rng.shuffle(order)
        for w in loads:
            for c in order:
                times[w.name][c].append(cases[c].run(w))
    out = {}
    for w in loads:
        nbytes = workload_bytes(w)
        out[w.name] = {"tokens": w.tokens, "bytes": nbytes, "cases": {}}
        for c, ts in times[w.name].items():
            med = statistics.median(ts)
            out[w.name]["cases"][c] = {"median_s": med, "gbps": nbytes / med / 1e9,
                                       "min_s": min(ts), "max_s": max(ts), "all_s": ts}
    return out


def ratios(results: dict) -> dict:
    out: dict[str, dict] = {}
    for wname, r in results.items():
        cases = r["cases"]
        out[wname] = {}
        for a, b, target in RATIOS:
            if a in cases and b in cases:
                value = cases[a]["gbps"] / cases[b]["gbps"]
                out[wname][f"{a}/{b}"] = {"value": value, "target": target,
                                          "met": value >= target}
    return out


def plot(results: dict, rat: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loads = list(results)
    names = list(next(iter(results.values()))["cases"])
    fig, ax = plt.subplots(figsize=(9, 4.8))
    width = 0.8 / len(names)
    for j, c in enumerate(names):
        vals = [results[w]["cases"][c]["gbps"] for w in loads]
        xs = [i + (j - (len(names) - 1) / 2) * width for i in range(len(loads))]
        bars = ax.bar(xs, vals, width, label=c)
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
    ax.set_xticks(range(len(loads)),
                  [f"{w} ({results[w]['bytes'] / 2**20:.0f} MiB)\n" + "  ".join(
                      f"{k} {v['value']:.2f}" for k, v in rat[w].items()) for w in loads],
                  fontsize=8)
    ax.set_ylabel("GB/s (median)")
    ax.set_title("KV page transfer, SmolLM2-135M layout (item 12 KiB), cross-process")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--prompts", default="512,4096", help="prompt lengths in tokens")
    ap.add_argument("--pool-pages", type=int, default=1024, help="pages per K/V buffer")
    ap.add_argument("--cases", default=",".join(DEFAULT_CASES),
                    help=f"comma-separated, from: {', '.join(CASES)}")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(RESULTS / "transfer.json"))
    args = ap.parse_args(argv)
    names = [c for c in args.cases.split(",") if c]
    unknown = [c for c in names if c not in CASES]
    if unknown or args.reps < 1:
        print(f"unknown cases {unknown}; known: {', '.join(CASES)} (and --reps >= 1)",
              file=sys.stderr)
        return 2
    loads = workloads(args.pool_pages, [int(x) for x in args.prompts.split(",")], args.seed)
    env = Env(HostKV(args.pool_pages, fill=True), args.pool_pages,
              max(workload_bytes(w) for w in loads))
    src_layout = layout(*env.src.bases(), args.pool_pages)
    for w in loads:
        w.copies = len(DefaultPlanner().plan(src_layout, src_layout, w.src_pages, w.dst_pages))
    cases: dict[str, Case] = {}
    try:
        for c in names:
            cases[c] = CASES[c](env)
        results = measure(cases, loads, args.reps)
    finally:
        for c in cases.values():
            c.close()
    rat = ratios(results)
    for w, r in results.items():
        r["copies"] = next(x.copies for x in loads if x.name == w)
        print(f"{w}: {r['bytes'] / 2**20:.1f} MiB in {r['copies']} copies")
        for c, v in r["cases"].items():
            print(f"  {c:12s} {v['gbps']:7.2f} GB/s  (median {v['median_s'] * 1e3:.2f} ms, "
                  f"min {v['min_s'] * 1e3:.2f}, max {v['max_s'] * 1e3:.2f})")
        for k, v in rat[w].items():
            print(f"  {k:18s} {v['value']:6.2f}  target >= {v['target']}  "
                  f"{'MET' if v['met'] else 'MISSED'}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"model": MODEL | {"item_len": item_len()}, "pool_pages": args.pool_pages,
           "reps": args.reps, "seed": args.seed,
           "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                       "platform": platform.platform()},
           "results": results, "ratios": rat}
    out.write_text(json.dumps(doc, indent=1))
    plot(results, rat, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
