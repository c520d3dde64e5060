"""bench/transfer.py cases for the vendor backends (pd-mooncake, pd-nixl), each next to the same
bytes moved with the vendor library's batch API called directly, in the same run.

1. `register(t)` (t: the bench/transfer.py module) adds the cases to t.CASES and the ratios
   (pdserve backend / direct library use, target >= 0.9) to t.RATIOS;
2. every case writes the workload's CopyBatch from the core's DefaultPlanner (page runs
   coalesced) into a peer process that runs the pdserve engine of that backend with the KV
   buffers registered (the receiving side is the same for both: a passive registered engine);
3. `mooncake` / `nixl` go through the pdserve engine (write + poll, as the core does);
   `mooncake_direct`: `batch_transfer_sync_write` in chunks of 1024 descriptors (Mooncake's TCP
   transport refuses more than ~2048 in flight per peer);
   `nixl_direct`: `initialize_xfer` over the same descriptor arrays + `transfer` + spin on
   `check_xfer_state`; `nixl_prepped`: `make_prepped_xfer` on descriptor lists prepared before
   the clock starts (the fastest use of NIXL's API).
Run: `python bench/transfer.py --pool-pages 512 --cases mooncake,mooncake_direct,nixl,nixl_direct,nixl_prepped`
(bench/results/transfer_vendors.json), and Mooncake alone, with fewer processes sharing the cores:
`python bench/transfer.py --pool-pages 512 --reps 21 --cases mooncake,mooncake_direct
--out bench/results/transfer_mooncake.json`. Both stored runs predate `--burst` and ran one
transfer per turn (`--burst 1`, `--reps 11` for the first).
"""

from __future__ import annotations

import os
import time
from types import ModuleType
from typing import Any

import numpy as np

MOONCAKE_ENV = {"MOONCAKE_PROTOCOL": "tcp"}
MOONCAKE_CHUNK = 1024


def _process_env() -> None:
    # read by the libraries themselves, in this process and in the spawned peers
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")  # loopback only
    os.environ.setdefault("UCX_MODULES", "^ib")  # else UCX processes segfault at exit
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")


def _require(module: str, hint: str) -> None:
    import importlib

    try:
        importlib.import_module(module)
    except ImportError as e:
        raise RuntimeError(f"{module} is unavailable ({e}): {hint}") from None


def register(t: ModuleType) -> None:
    class MooncakeDirect(t.EngineCase):
        """Mooncake's batch API on the calling thread, into the same kind of peer."""

        def __init__(self, env: Any) -> None:
            super().__init__("mooncake_direct", "pd_mooncake.engine:MooncakeEngine", "host",
                             env.src, env.pool_pages, env=MOONCAKE_ENV)
            self.engine.close()  # only the peer and the planned batches are shared
            from mooncake.engine import TransferEngine

            self.raw = TransferEngine()
            if self.raw.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
                raise RuntimeError("mooncake initialize failed")
            regions = env.src.regions
            if self.raw.batch_register_memory([r.addr for r in regions],
                                              [r.length for r in regions]) != 0:
                raise RuntimeError("mooncake batch_register_memory failed")
            self.target = self.peer.endpoint.decode()
            self.lists: dict[str, tuple[list[int], list[int], list[int]]] = {}

        def run(self, w: Any) -> float:
            if w.name not in self.lists:  # conversion outside the clock, as a caller would cache
                b = self.batch(w)
                self.lists[w.name] = (b.src.tolist(), b.dst.tolist(), b.length.tolist())
            src, dst, length = self.lists[w.name]
            t0 = time.perf_counter()
            for lo in range(0, len(src), MOONCAKE_CHUNK):
                hi = lo + MOONCAKE_CHUNK
                rc = self.raw.batch_transfer_sync_write(self.target, src[lo:hi], dst[lo:hi],
                                                        length[lo:hi])
                if rc != 0:
                    raise RuntimeError(f"mooncake_direct: batch_transfer_sync_write returned {rc}")
            return time.perf_counter() - t0

        def close(self) -> None:
            super().close()
            self.raw = None

    class NixlDirect(t.EngineCase):
        """NIXL's API on the calling thread: per-batch descriptor lists, or prepared ones."""

        def __init__(self, env: Any, prepped: bool) -> None:
            name = "nixl_prepped" if prepped else "nixl_direct"
            super().__init__(name, "pd_nixl.engine:NixlEngine", "host", env.src, env.pool_pages)
            self.engine.close()  # only the peer and the planned batches are shared
            from nixl._api import nixl_agent, nixl_agent_config

            self.prepped = prepped
            # the pdserve engine's default: no NIXL progress thread on the sending side either
            self.agent = nixl_agent(f"bench-{name}-{os.getpid()}",
                                    nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
            self.agent.register_memory([(r.addr, r.length, 0, "") for r in env.src.regions], "DRAM")
            self.remote = self.agent.add_remote_agent(self.peer.endpoint)
            self.remote = self.remote.decode() if isinstance(self.remote, bytes) else self.remote
            self.prepared: dict[str, Any] = {}

        def _descs(self, w: Any) -> tuple[np.ndarray, np.ndarray]:
            b = self.batch(w)
            zeros = np.zeros(len(b), dtype=np.uint64)
            return np.stack([b.src, b.length, zeros], 1), np.stack([b.dst, b.length, zeros], 1)

        def run(self, w: Any) -> float:
            local, remote = self._descs(w)
            if self.prepped and w.name not in self.prepared:
                lh = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", local, "DRAM")
                rh = self.agent.prep_xfer_dlist(self.remote, remote, "DRAM")
                self.prepared[w.name] = (lh, rh, np.arange(len(local), dtype=np.int32))
            t0 = time.perf_counter()
            if self.prepped:
                lh, rh, idx = self.prepared[w.name]
                xfer = self.agent.make_prepped_xfer("WRITE", lh, idx, rh, idx)
            else:
                xfer = self.agent.initialize_xfer(
                    "WRITE", self.agent.get_xfer_descs(local, "DRAM"),
                    self.agent.get_xfer_descs(remote, "DRAM"), self.remote)
            state = self.agent.transfer(xfer)
            while state == "PROC":
                state = self.agent.check_xfer_state(xfer)
            dt = time.perf_counter() - t0
            xfer.release()
            if state != "DONE":
                raise RuntimeError(f"{self.name}: NIXL state {state}")
            return dt

        def close(self) -> None:
            for lh, rh, _ in self.prepared.values():
                lh.release()
                rh.release()
            self.prepared.clear()
            super().close()
            self.agent = None

    def bench_mooncake(env: Any) -> Any:
        _process_env()
        _require("pd_mooncake.engine", "pip install -e plugins/pd-mooncake and its SDK")
        return t.EngineCase("mooncake", "pd_mooncake.engine:MooncakeEngine", "host", env.src,
                            env.pool_pages, env=MOONCAKE_ENV)

    def bench_mooncake_direct(env: Any) -> Any:
        _process_env()
        _require("pd_mooncake.engine", "pip install -e plugins/pd-mooncake and its SDK")
        return MooncakeDirect(env)

    def bench_nixl(env: Any) -> Any:
        _process_env()
        _require("pd_nixl.engine", "pip install -e plugins/pd-nixl (and nixl)")
        return t.EngineCase("nixl", "pd_nixl.engine:NixlEngine", "host", env.src, env.pool_pages)

    def bench_nixl_direct(env: Any) -> Any:
        _process_env()
        _require("pd_nixl.engine", "pip install -e plugins/pd-nixl (and nixl)")
        return NixlDirect(env, prepped=False)

    def bench_nixl_prepped(env: Any) -> Any:
        _process_env()
        _require("pd_nixl.engine", "pip install -e plugins/pd-nixl (and nixl)")
        return NixlDirect(env, prepped=True)

    t.CASES.update({
        "mooncake": bench_mooncake,
        "mooncake_direct": bench_mooncake_direct,
        "nixl": bench_nixl,
        "nixl_direct": bench_nixl_direct,
        "nixl_prepped": bench_nixl_prepped,
    })
    t.RATIOS.extend([
        ("mooncake", "mooncake_direct", 0.9),
        ("nixl", "nixl_direct", 0.9),
        ("nixl", "nixl_prepped", 0.9),
    ])
