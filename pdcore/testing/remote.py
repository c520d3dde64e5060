"""Backend contract settings, and a receiver engine running in a spawned child process.

1. `RemoteReceiver(spec)` spawns a child (multiprocessing "spawn": a fresh interpreter that
   loads its own plugin host, as a real decode server does);
2. the child builds the engine and the destination buffers from the memory pool, fills them with
   a sentinel pattern the parent can recompute, registers them and sends back its endpoint and
   regions;
3. the parent connects its sender engine and writes; `read(i)` asks the child for buffer i's
   bytes;
4. `close()` asks the child to close its engine and pool and exit; `kill()` SIGKILLs it (a dead
   peer). The child leaves through os._exit so a vendor SDK crashing in its destructors at exit
   (NIXL does) cannot fail the test.
"""

from __future__ import annotations

import multiprocessing
import os
import traceback
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch

from pdcore.interfaces.memory import Buffer, MemoryPool, PoolContext
from pdcore.interfaces.transfer import BackendContext, MemoryRegion, TransferEngine
from pdcore.plugins.host import memory_pools, transfer_backends
from pdcore.plugins.lazy import load


def sentinel(seed: int, index: int, nbytes: int) -> np.ndarray:
    """The initial content of destination buffer `index`: random, so stray writes show."""
    return np.random.default_rng([seed, index]).integers(0, 256, nbytes, dtype=np.uint8)


def buffer_bytes(buf: Buffer) -> np.ndarray:
    """A copy of a buffer's bytes (device tensors too)."""
    return buf.tensor.detach().reshape(-1).cpu().numpy().view(np.uint8).copy()


def fill_buffer(buf: Buffer, data: np.ndarray) -> None:
    buf.tensor.reshape(-1).copy_(torch.from_numpy(data).to(buf.tensor.device))


class ComponentUnavailable(Exception):
    """The backend or pool is installed but reports it cannot run here (reason in args)."""


def create_engine(backend_name: str, engine_factory: str, ctx: BackendContext) -> TransferEngine:
    if engine_factory:
        return load(engine_factory)(ctx)
    if not backend_name:
        raise ValueError("set backend_name (a registered name) or engine_factory ('mod:attr')")
    ok, reason = transfer_backends().get(backend_name).available()
    if not ok:
        raise ComponentUnavailable(f"transfer backend {backend_name!r}: {reason}")
    return transfer_backends().create(backend_name, ctx)


def create_pool(pool_name: str, ctx: PoolContext) -> MemoryPool:
    ok, reason = memory_pools().get(pool_name).available()
    if not ok:
        raise ComponentUnavailable(f"memory pool {pool_name!r}: {reason}")
    return memory_pools().create(pool_name, ctx)


def _server_id(role: str) -> str:
    return f"contract-{role}-{uuid.uuid4().hex[:8]}"


@dataclass(frozen=True)
class ReceiverSpec:
    backend_name: str
    engine_factory: str
    pool_name: str
    device: str
    region_bytes: int
    n_regions: int
    seed: int
    env: dict[str, str] = field(default_factory=dict)


class BackendSettings:
    """What a backend contract subclass may set (class attributes) or override (methods)."""

    backend_name: str = ""  # registered transfer backend name
    engine_factory: str = ""  # or "module:attr" called with a BackendContext (no registry)
    pool_name: str = "torch"  # memory pool giving both sides' buffers (e.g. "shm")
    device: str = "cpu"
    region_bytes: int = 1 << 20  # size of each registered buffer
    regions_per_side: int = 2
    many_items: int = 2000  # copies in the "scattered" batch
    timeout: float = 30.0  # a healthy write must be DONE within this
    dead_peer_timeout: float = 30.0  # a write to a dead peer must be FAILED within this
    detects_dead_peer: bool = True  # False: such a write may end DONE (must still not hang)
    context_env: Mapping[str, str] = {}  # BackendContext.env for both engines
    spawn_timeout: float = 120.0  # child start-up (imports torch on a loaded machine)

    def make_context(self, role: str) -> BackendContext:
        return BackendContext(role=role, device=self.device, server_id=_server_id(role),
                              env=dict(self.context_env))

    def make_engine(self, role: str) -> TransferEngine:
        import pytest

        try:
            return create_engine(self.backend_name, self.engine_factory, self.make_context(role))
        except ComponentUnavailable as e:
            pytest.skip(str(e))

    def make_pool(self, role: str) -> MemoryPool:
        import pytest

        try:
            return create_pool(self.pool_name, PoolContext(server_id=_server_id(role),
                                                           device=self.device))
        except ComponentUnavailable as e:
            pytest.skip(str(e))

    def receiver_spec(self, seed: int) -> ReceiverSpec:
        return ReceiverSpec(self.backend_name, self.engine_factory, self.pool_name, self.device,
                            self.region_bytes, self.regions_per_side, seed, dict(self.context_env))


def receiver_main(conn: Connection, spec: ReceiverSpec) -> None:
    """Child process entry point (module-level so spawn can import it)."""
    try:
        ctx = BackendContext(role="decode", device=spec.device, server_id=_server_id("decode"),
                             env=dict(spec.env))
        pool = create_pool(spec.pool_name, PoolContext(server_id=ctx.server_id,
                                                       device=spec.device))
        engine = create_engine(spec.backend_name, spec.engine_factory, ctx)
        buffers = [pool.allocate(f"dst-{i}", (spec.region_bytes,), torch.uint8)
                   for i in range(spec.n_regions)]
        for i, buf in enumerate(buffers):
            fill_buffer(buf, sentinel(spec.seed, i, spec.region_bytes))
        regions = [b.region for b in buffers]
        engine.register(regions)
        conn.send(("ready", engine.endpoint(), [r.to_dict() for r in regions]))
    except BaseException:  # noqa: BLE001 - report anything (even SystemExit) to the parent
        conn.send(("error", traceback.format_exc()))
        os._exit(1)
    while True:
        try:
            cmd = conn.recv()
        except (EOFError, OSError):  # parent gone
            break
        if cmd[0] == "read":
            conn.send(("data", buffer_bytes(buffers[cmd[1]]).tobytes()))
        elif cmd[0] == "close":
            engine.close()
            pool.close()
            conn.send(("closed",))
            break
    os._exit(0)


class RemoteReceiver:
    """A receiver engine with registered destination buffers in a spawned child process."""

    def __init__(self, spec: ReceiverSpec, timeout: float = 120.0) -> None:
        self.spec = spec
        self.seed = spec.seed
        self.timeout = timeout
        mp = multiprocessing.get_context("spawn")
        self._conn, child = mp.Pipe()
        self.proc = mp.Process(target=receiver_main, args=(child, spec), daemon=True,
                               name="pdcore-contract-receiver")
        self.proc.start()
        child.close()
        try:
            msg = self._recv(timeout)
            if msg[0] != "ready":
                raise AssertionError(f"receiver process failed to start:\n{msg[1]}")
        except BaseException:
            self.kill()
            raise
        self.endpoint: bytes = msg[1]
        self.regions = [MemoryRegion.from_dict(d) for d in msg[2]]

    def _recv(self, timeout: float) -> Any:
        if not self._conn.poll(timeout):
            raise TimeoutError(f"receiver process did not answer within {timeout}s")
        try:
            return self._conn.recv()
        except EOFError:
            self.proc.join(5)
            raise AssertionError(
                f"receiver process exited (exit code {self.proc.exitcode})") from None

    def read(self, index: int) -> np.ndarray:
        self._conn.send(("read", index))
        msg = self._recv(self.timeout)
        return np.frombuffer(msg[1], dtype=np.uint8)

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)

    def close(self) -> None:
        try:
            if self.proc.is_alive():
                self._conn.send(("close",))
                self._recv(30.0)
                self.proc.join(10)
        except (OSError, EOFError, TimeoutError, AssertionError):
            pass  # already dead or stuck: the kill below settles it
        finally:
            self.kill()
            self._conn.close()

    def __enter__(self) -> RemoteReceiver:  # noqa: PYI034
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
