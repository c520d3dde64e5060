"""Transfer backend `ascend` over memfabric-hybrid: the only module that imports `memfabric_hybrid`.

Lifecycle of a MemfabricEngine:
1. settings from the context: store URL (ASCEND_MF_STORE_URL), protocol
   (ASCEND_MF_TRANSFER_PROTOCOL), role, logical NPU id, advertised host (ConfigError when bad);
2. memfabric's stdout log is captured around the start-up calls (pd_ascend.mf_log), so their
   failures quote the library's own error lines; write failures quote get_last_err_msg();
3. `TransferEngine.initialize(store, "ip:port", role, device, op type)`; a non-zero answer
   destroys the engine and raises TransferError with memfabric's text;
4. register() registers every region in one batch_register_memory call;
5. endpoint() is the session id `ip:rpc_port`; connect() only validates the peer's (memfabric
   connects lazily on the first transfer);
6. write() hands the batch to a worker thread that calls batch_transfer_sync_write; poll()
   reports it; a failure carries memfabric's text;
7. close() waits for the workers, then unInitialize() and destroy(); idempotent.

`start_config_store(url)` starts memfabric's config store in this process (see pd_ascend.store).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Sequence
from typing import Any

import memfabric_hybrid as mf

from pd_ascend import mf_log
from pd_ascend.settings import PROTOCOLS, MemfabricSettings, StoreUrl
from pdcore.backendkit import HandleEngine, HandleTable, TransferJobs, host_port
from pdcore.errors import ConfigError, TransferError
from pdcore.interfaces.transfer import (
    BackendContext,
    Capabilities,
    CopyBatch,
    MemoryKind,
    MemoryRegion,
    Peer,
)

log = logging.getLogger("pd_ascend")

MAX_BATCH = 8192  # copies per batch_transfer_sync_write call; the core splits larger batches


def mf_failure(call: str, rc: object, output: str = "") -> str:
    """memfabric's words for the failure of `call`: this thread's ERROR lines in `output` (its
    log captured during the call), else get_last_err_msg()."""
    try:
        last = str(mf.get_and_clear_last_err_msg() or "")
    except Exception:  # noqa: BLE001 - diagnostics only
        last = ""
    own = mf_log.errors(output, threading.get_native_id())
    return mf_log.describe_failure(call, rc, own, last)


def start_config_store(url: StoreUrl) -> None:
    """Start memfabric's config store at `url` in this process (it lives until the process
    exits; memfabric has no call to stop it). Raises ConfigError with memfabric's reason."""
    with mf_log.captured_stdout() as out:
        rc = mf.create_config_store(str(url))
    if rc != 0:
        raise ConfigError(mf_failure(f"create_config_store({str(url)!r})", rc, out.text))


class MemfabricDataPath:
    """Registration and batched writes over a memfabric TransferEngine (initialized or not)."""

    def __init__(self, mf_engine: Any, threads: int) -> None:
        self.mf = mf_engine
        # one queue: writes to every peer share the threads in order of arrival
        self.jobs = TransferJobs("ascend", threads, label="pd-ascend-mf")
        self.registered: dict[int, int] = {}

    def register(self, regions: Sequence[MemoryRegion], kinds: frozenset[MemoryKind]) -> None:
        fresh = [r for r in regions if r.addr not in self.registered]
        for r in fresh:
            if r.kind not in kinds:
                raise TransferError(f"transfer backend 'ascend' cannot register {r.kind.value} "
                                    f"memory ({r.name or hex(r.addr)}); it takes "
                                    f"{sorted(k.value for k in kinds)}")
            if r.length <= 0:
                raise TransferError(f"region {r.name or hex(r.addr)} has length {r.length}")
        if not fresh:
            return
        with mf_log.captured_stdout() as out:
            rc = self.mf.batch_register_memory([r.addr for r in fresh], [r.length for r in fresh])
        if rc != 0:
            raise TransferError(mf_failure(f"batch_register_memory of {len(fresh)} regions", rc,
                                           out.text))
        for r in fresh:
            self.registered[r.addr] = r.length

    def write(self, target: str, batch: CopyBatch) -> int:
        return self.jobs.submit(target, functools.partial(
            self._send, target, batch.src.tolist(), batch.dst.tolist(), batch.length.tolist()))

    def _send(self, target: str, src: list[int], dst: list[int], length: list[int]) -> str | None:
        """Worker thread: one blocking batch write; None when every copy landed."""
        if not src:
            return None
        # no stdout capture here: writes run concurrently on several threads
        rc = self.mf.batch_transfer_sync_write(target, src, dst, length)
        if rc == 0:
            return None
        return mf_failure(f"batch_transfer_sync_write of {len(src)} copies to {target}", rc)


class MemfabricEngine(HandleEngine):
    name = "ascend"

    def __init__(self, ctx: BackendContext) -> None:
        self.settings = s = MemfabricSettings.from_context(ctx)
        # KV lives on the NPU; the core keeps aux rows in host memory and registers them too
        self.capabilities = Capabilities(memory_kinds=frozenset({MemoryKind.NPU, MemoryKind.HOST}),
                                         max_batch=MAX_BATCH)
        engine = mf.TransferEngine()
        # SGLang's convention: the session id carries the port the engine reports before
        # initialize(); memfabric 1.3 answers 0 there and picks the real port itself
        session = f"{s.host}:{int(engine.get_rpc_port())}"
        op_type = getattr(mf.TransDataOpType, PROTOCOLS[s.protocol])
        with mf_log.captured_stdout() as out:
            rc = engine.initialize(str(s.store_url), session, s.role, s.device_id, op_type)
        if rc != 0:
            reason = mf_failure(
                f"TransferEngine.initialize(store {s.store_url}, session {session}, role "
                f"{s.role}, device {s.device_id}, {s.protocol})", rc, out.text)
            engine.destroy()
            raise TransferError(reason)
        port = int(engine.get_rpc_port())
        self.session_id = f"{s.host}:{port}" if port > 0 else session
        self._mf: Any = engine
        self._data = MemfabricDataPath(engine, s.threads)
        self._closed = False
        log.info("memfabric engine %s ready (role %s, npu %d, %s, store %s)", self.session_id,
                 s.role, s.device_id, s.protocol, s.store_url)

    def _live(self) -> MemfabricDataPath:
        if self._closed:
            raise TransferError("the ascend (memfabric) engine is closed; create a new one")
        return self._data

    def register(self, regions: Sequence[MemoryRegion]) -> None:
        self._live().register(regions, self.capabilities.memory_kinds)

    def deregister(self, regions: Sequence[MemoryRegion]) -> None:
        # memfabric 1.3 has no unregister call: the regions stay registered until close()
        for r in regions:
            self._data.registered.pop(r.addr, None)

    def endpoint(self) -> bytes:
        self._live()
        return self.session_id.encode()

    def connect(self, peer_endpoint: bytes, peer_regions: Sequence[MemoryRegion]) -> Peer:
        self._live()
        target = parse_session(peer_endpoint)
        return Peer(endpoint=bytes(peer_endpoint), key=target, state=list(peer_regions))

    def write(self, peer: Peer, batch: CopyBatch) -> int:
        return self._live().write(peer.key, batch)

    @property
    def handles(self) -> HandleTable:  # poll() and wait() (HandleEngine) answer from these
        return self._data.jobs.handles

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # no bound: a thread may still be inside memfabric, which must not be torn down under it
        self._data.jobs.close(join_timeout=None)
        self._mf.unInitialize()
        self._mf.destroy()
        self._data.registered.clear()


def parse_session(peer_endpoint: bytes) -> str:
    """A peer's endpoint blob -> memfabric session id "ip:port"; TransferError when malformed."""
    return host_port(peer_endpoint, "ascend", "ip:port")


def create(ctx: BackendContext) -> MemfabricEngine:
    return MemfabricEngine(ctx)
