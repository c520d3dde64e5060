"""The Mooncake transfer engine as a pdserve backend: the only module that imports `mooncake`.

Lifecycle of a MooncakeEngine:
1. settings come from the context (protocol, MC_FORCE_TCP, RDMA devices, custom pool, bounds);
2. a custom memory pool, if SGLANG_MOONCAKE_CUSTOM_MEM_POOL asks for one, is checked against
   this machine and wheel: ConfigError at start-up when it cannot be honoured;
3. initialize(host, "P2PHANDSHAKE", protocol, devices); the transport really installed is read
   back from the local topology (rdma without a NIC silently becomes tcp: warned, reported);
4. register() registers every region in one batch_register_memory call;
5. connect() probes the peer "host:rpc_port"; write() queues a job that sends the batch in
   sub-batches (batch_transfer_async_write + get_batch_transfer_status) of at most `sub_batch`
   requests, two in flight when the per-peer in-flight budget has room, each holding its share;
6. poll() reports the job; close() stops the workers and unregisters the memory.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Sequence
from typing import Any

import mooncake.engine as mc

from pd_mooncake.settings import MooncakeSettings, detect_transport, rdma_devices
from pd_mooncake.workers import InflightBudget, TransferWorkers
from pdcore.backendkit import HandleEngine, HandleTable, host_port
from pdcore.errors import ConfigError, TransferError
from pdcore.interfaces.transfer import (
    BackendContext,
    Capabilities,
    CopyBatch,
    MemoryKind,
    MemoryRegion,
    Peer,
)

log = logging.getLogger("pd_mooncake")

SUPPORTS_CUDA = bool(getattr(mc, "SUPPORT_CUDA", False))


def cuda_pool_support(kind: str) -> tuple[bool, str]:
    """Whether the custom CUDA pool `kind` (NVLINK | BAREX | INTRA_NODE_NVLINK) can work here."""
    import torch

    if not torch.cuda.is_available():
        return False, "it needs a CUDA GPU and torch.cuda.is_available() is False here"
    if not SUPPORTS_CUDA:
        return False, ("the installed mooncake wheel was built without CUDA "
                       "(mooncake-transfer-engine-non-cuda?); pip install mooncake-transfer-engine")
    if kind == "NVLINK" and not getattr(mc, "SUPPORT_MNNVL", False):
        return False, "the installed mooncake wheel was built without the NVLink transport (USE_MNNVL)"
    if kind == "INTRA_NODE_NVLINK" and not getattr(mc, "SUPPORT_INTRA_NVLINK", False):
        return False, ("the installed mooncake wheel was built without the intra-node NVLink "
                       "transport (USE_INTRA_NVLINK)")
    if kind in ("NVLINK", "BAREX"):
        try:
            custom_allocator_class(kind)
        except ImportError as e:
            return False, f"mooncake.allocator is unusable: {e}"
    return True, ""


def custom_allocator_class(kind: str) -> Any:
    """Mooncake's allocator class for a custom pool (its get_allocator(device) gives a
    torch CUDAPluggableAllocator); INTRA_NODE_NVLINK uses the default CUDA allocator."""
    from mooncake import allocator  # present in the CUDA wheel only

    return {"NVLINK": allocator.NVLinkAllocator, "BAREX": allocator.BarexAllocator}[kind]


class MooncakeEngine(HandleEngine):
    name = "mooncake"

    def __init__(self, ctx: BackendContext) -> None:
        self.settings = MooncakeSettings.from_context(ctx)
        s = self.settings
        if s.custom_pool is not None:
            ok, reason = cuda_pool_support(s.custom_pool)
            if not ok:
                raise ConfigError(
                    f"SGLANG_MOONCAKE_CUSTOM_MEM_POOL={s.custom_pool} cannot be honoured: {reason}. "
                    f"Unset SGLANG_MOONCAKE_CUSTOM_MEM_POOL on machines without CUDA."
                )
        if s.protocol == "efa" and not getattr(mc, "SUPPORT_EFA", False):
            raise ConfigError("MOONCAKE_PROTOCOL=efa but the installed mooncake wheel was built "
                              "without EFA support; use rdma or tcp")
        kinds = {MemoryKind.HOST, MemoryKind.SHM} | ({MemoryKind.CUDA} if SUPPORTS_CUDA else set())
        self.capabilities = Capabilities(memory_kinds=frozenset(kinds))
        self.host = ctx.host
        self._engine: Any = mc.TransferEngine()
        rc = self._engine.initialize(ctx.host, "P2PHANDSHAKE", s.protocol, s.device_name)
        if rc != 0:
            self._engine = None
            call = (f"mooncake TransferEngine.initialize({ctx.host!r}, 'P2PHANDSHAKE', "
                    f"{s.protocol!r}, {s.device_name!r}) returned {rc}")
            if s.force_hca and s.protocol != "tcp":
                raise ConfigError(
                    f"{call}: MC_FORCE_HCA is set, so Mooncake refused to fall back to TCP and "
                    f"found no usable RDMA NIC. Check --disaggregation-ib-device, or unset "
                    f"MC_FORCE_HCA to allow TCP, or set MOONCAKE_PROTOCOL=tcp."
                )
            raise TransferError(f"{call}; see the mooncake log above for the cause")
        self.rpc_port = int(self._engine.get_rpc_port())
        # get_local_topology() re-runs discovery (about 1 s); without any RDMA device in sysfs
        # the answer is known: mooncake cannot find a NIC either and installs TCP
        topology = self._engine.get_local_topology() if rdma_devices() else "{}"
        self.transport, warning = detect_transport(s, topology)
        if warning:
            log.warning("%s", warning)
        self.fallback_warning = warning
        self._budget = InflightBudget(s.inflight_per_peer)
        self._workers = TransferWorkers(s.thread_pool_size, s.queue_size)
        self._registered: dict[int, int] = {}
        log.info("mooncake engine %s:%d ready: transport %s (asked %s), devices %r",
                 ctx.host, self.rpc_port, self.transport, s.protocol, s.device_name or "auto")

    def describe(self) -> dict[str, Any]:
        s = self.settings
        return {"backend": self.name, "endpoint": f"{self.host}:{self.rpc_port}",
                "transport": self.transport, "protocol": s.protocol, "devices": s.device_name,
                "sub_batch": s.sub_batch, "inflight_per_peer": s.inflight_per_peer,
                "threads": len(self._workers.threads), "queues": self._workers.queue_size}

    def _live(self) -> Any:
        if self._engine is None:
            raise TransferError("mooncake engine is closed; create a new one")
        return self._engine

    # -- memory ------------------------------------------------------------------------------
    def register(self, regions: Sequence[MemoryRegion]) -> None:
        engine = self._live()
        fresh = [r for r in regions if r.addr not in self._registered]
        for r in fresh:
            if r.kind not in self.capabilities.memory_kinds:
                raise TransferError(
                    f"mooncake cannot register {r.kind.value} memory ({r.name or hex(r.addr)}) with "
                    f"this wheel; supported: {sorted(k.value for k in self.capabilities.memory_kinds)}"
                )
            if r.length <= 0:
                raise TransferError(f"region {r.name or hex(r.addr)} has length {r.length}")
        if not fresh:
            return
        rc = engine.batch_register_memory([r.addr for r in fresh], [r.length for r in fresh])
        if rc != 0:
            raise TransferError(f"mooncake batch_register_memory of {len(fresh)} regions returned "
                                f"{rc}; see the mooncake log")
        for r in fresh:
            self._registered[r.addr] = r.length

    def deregister(self, regions: Sequence[MemoryRegion]) -> None:
        addrs = [r.addr for r in regions if r.addr in self._registered]
        if not addrs or self._engine is None:
            return
        rc = self._engine.batch_unregister_memory(addrs)
        for a in addrs:
            self._registered.pop(a, None)
        if rc != 0:
            log.warning("mooncake batch_unregister_memory returned %d", rc)

    # -- peers -------------------------------------------------------------------------------
    def endpoint(self) -> bytes:
        self._live()
        return f"{self.host}:{self.rpc_port}".encode()

    def connect(self, peer_endpoint: bytes, peer_regions: Sequence[MemoryRegion]) -> Peer:
        engine = self._live()
        target = host_port(peer_endpoint, "mooncake")
        rc = engine.send_probe(target)  # also performs the handshake once, off the hot path
        if rc != 0:
            raise TransferError(f"cannot reach mooncake peer {target}: send_probe returned {rc} "
                                f"(the peer is down or the address is wrong)")
        return Peer(endpoint=bytes(peer_endpoint), key=target, state=list(peer_regions))

    # -- data --------------------------------------------------------------------------------
    def write(self, peer: Peer, batch: CopyBatch) -> int:
        engine = self._live()
        if len(batch) == 0:
            return self._workers.finished()
        return self._workers.submit(peer.key, functools.partial(self._send, engine, peer.key, batch))

    def _send(self, engine: Any, target: str, batch: CopyBatch) -> str | None:
        """Runs on a worker thread: the whole batch in bounded sub-batches; None when done.

        Two sub-batches are kept in flight when the per-peer budget has room at once (the next
        one is submitted before waiting for the current one, so the transport never idles
        between them). The second is only ever taken without waiting: a thread blocks on the
        budget only while it holds none of it, so two threads cannot hold half each and wait.
        """
        src, dst, length = batch.src.tolist(), batch.dst.tolist(), batch.length.tolist()
        n, step = len(src), self.settings.sub_batch
        budget_wait = 2 * self.settings.transfer_timeout_s + 5.0
        flying: list[tuple[int, int, int, float]] = []  # (batch id, lo, hi, submit time)

        def settle(bid: int, lo: int, hi: int, t0: float) -> str | None:
            try:
                rc = engine.get_batch_transfer_status([bid]) if bid else None
            finally:
                self._budget.release(target, hi - lo)
            if rc == 0:
                return None
            what = (f"batch_transfer_async_write of requests {lo}..{hi - 1} of {n}" if bid else
                    f"batch_transfer_async_write submit of requests {lo}..{hi - 1} of {n}")
            return self._failure_reason(engine, target, what, rc, time.monotonic() - t0)

        try:
            for lo in range(0, n, step):
                hi = min(n, lo + step)
                # next to a sub-batch in flight, take room only if it is free at once; else
                # finish that one first, and only then wait for room
                if not (flying and self._budget.acquire(target, hi - lo, 0.0)):
                    if flying and (reason := settle(*flying.pop(0))) is not None:
                        return reason
                    if not self._budget.acquire(target, hi - lo, budget_wait):
                        return (f"waited {budget_wait:.0f}s for room among the requests in flight "
                                f"to {target} (limit {self._budget.limit}, "
                                f"MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER + "
                                f"MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER)")
                t0 = time.monotonic()
                try:
                    bid = engine.batch_transfer_async_write(target, src[lo:hi], dst[lo:hi],
                                                            length[lo:hi])
                except BaseException:
                    self._budget.release(target, hi - lo)
                    raise
                flying.append((bid, lo, hi, t0))
                if len(flying) > 1 and (reason := settle(*flying.pop(0))) is not None:
                    return reason
            while flying:
                if (reason := settle(*flying.pop(0))) is not None:
                    return reason
            return None
        finally:
            for bid, lo, hi, _ in flying:  # after a failure: wait out what is still moving
                if bid:
                    with contextlib.suppress(Exception):  # already failing; the reason is set
                        engine.get_batch_transfer_status([bid])
                self._budget.release(target, hi - lo)

    def _failure_reason(self, engine: Any, target: str, what: str, rc: int | None,
                        elapsed: float) -> str:
        base = f"mooncake {what} to {target} failed (status {rc if rc is not None else 'batch id 0'})"
        timeout = self.settings.transfer_timeout_s
        if elapsed >= timeout - 0.5:
            return (f"{base} after {elapsed:.1f}s: the peer did not complete within "
                    f"MC_TRANSFER_TIMEOUT={timeout:.0f}s (frozen or overloaded)")
        probe = engine.send_probe(target)
        if probe != 0:
            return f"{base}: the peer is unreachable (send_probe returned {probe}); it exited or restarted"
        return (f"{base}: the peer is reachable, so it refused the batch (a destination outside its "
                f"registered memory, or its per-peer queue overflowed); see the mooncake log")

    @property
    def handles(self) -> HandleTable:  # poll() and wait() (HandleEngine) answer from these
        return self._workers.handles

    def close(self) -> None:
        if self._engine is None:
            return
        self._workers.close()
        if self._registered:
            rc = self._engine.batch_unregister_memory(list(self._registered))
            if rc != 0:
                log.warning("mooncake batch_unregister_memory returned %d at close", rc)
            self._registered.clear()
        self._engine = None


def create(ctx: BackendContext) -> MooncakeEngine:
    return MooncakeEngine(ctx)
