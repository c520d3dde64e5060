"""NIXL as a pdserve transfer backend: the only module that imports `nixl`.

Lifecycle of a NixlEngine:
1. settings from the context env (backend plugin, its params, progress mode);
2. one agent per engine, named uniquely; the backend plugin is checked against the list NIXL
   reports (ConfigError listing it otherwise) and created with the params; a plugin whose library
   does not load is reported with the dynamic loader's own message;
3. register() registers regions by kind (DRAM for host and shared memory, VRAM for CUDA);
4. endpoint() is the agent metadata (it lists the regions registered so far);
   connect() loads a peer's metadata and checks its regions by preparing a descriptor list;
5. write() builds the local and remote descriptor lists of the batch (one pair per memory kind
   pair), creates the WRITE request and posts it; poll() checks its state and releases it;
   any NIXL error becomes FAILED with NIXL's status code and what it means;
6. close() stops the progress pump, releases requests, remote agents and registrations.
A "pump" thread (default) makes the calls that give NIXL progress on the receiving side, in
place of NIXL's own progress thread, which busy-polls a core per agent.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import os
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from nixl import _bindings
from nixl._api import nixl_agent, nixl_agent_config

from pd_nixl.settings import NixlSettings, describe_error
from pdcore.backendkit import HandleEngine, HandleTable, RegionIndex
from pdcore.env import environ
from pdcore.errors import ConfigError, TransferError
from pdcore.interfaces.transfer import (
    DONE,
    PENDING,
    BackendContext,
    Capabilities,
    CopyBatch,
    MemoryKind,
    MemoryRegion,
    Peer,
    PollResult,
    failed,
)

log = logging.getLogger("pd_nixl")

# NIXL's status exceptions (nixlBackendError, nixlRemoteDisconnectError, ...) share no base
# class but Exception; its Python layer adds RuntimeError / TypeError / KeyError / ValueError.
NIXL_ERRORS: tuple[type[Exception], ...] = tuple(
    c for n, c in vars(_bindings).items()
    if n.startswith("nixl") and n.endswith("Error") and isinstance(c, type)
    and issubclass(c, Exception)
) + (RuntimeError, TypeError, KeyError, ValueError, TransferError)

NIXL_MEM = {MemoryKind.HOST: "DRAM", MemoryKind.SHM: "DRAM", MemoryKind.CUDA: "VRAM"}
MEM_NAMES = ("DRAM", "VRAM")  # index = the code used in RegionKinds


def plugin_dirs(env: dict[str, str] | None = None) -> list[Path]:
    """Where NIXL looks for plugin libraries: NIXL_PLUGIN_DIR, then the wheel's bundled folder."""
    env = environ() if env is None else env
    dirs = [Path(env["NIXL_PLUGIN_DIR"])] if env.get("NIXL_PLUGIN_DIR") else []
    package = nixl_agent.__module__.split(".")[0]  # nixl_cu13, nixl_cu12, ...
    root = Path(importlib.import_module(package).__file__ or "").resolve().parent.parent
    dirs.append(root / f".{package}.mesonpy.libs" / "plugins")
    return dirs


def plugin_load_error(name: str) -> str | None:
    """The dynamic loader's message for NIXL plugin `name` (what NIXL logs when it cannot load
    it), or None when its library loads or cannot be found."""
    for d in plugin_dirs():
        path = d / f"libplugin_{name}.so"
        if path.is_file():
            try:
                ctypes.CDLL(str(path), mode=getattr(os, "RTLD_LOCAL", 0) | os.RTLD_LAZY)
            except OSError as e:
                return f"its library {path} does not load: {e}"
            return None
    return None


class RegionKinds:
    """NIXL memory type code and device id of the region each address falls in."""

    def __init__(self, regions: Sequence[MemoryRegion]) -> None:
        self.index = RegionIndex(regions)
        self.mem = np.array([MEM_NAMES.index(NIXL_MEM.get(r.kind, "DRAM"))
                             for r in self.index.regions], dtype=np.int64)
        self.dev = np.array([r.device_id for r in self.index.regions], dtype=np.uint64)

    @property
    def regions(self) -> tuple[MemoryRegion, ...]:
        return self.index.regions

    def lookup(self, addrs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if not len(self.index):
            zeros = np.zeros(len(addrs), dtype=np.int64)
            return zeros, zeros.astype(np.uint64)
        i = self.index.position(addrs)
        return self.mem[i], self.dev[i]


@dataclass(slots=True)
class _Transfer:
    """One write: NIXL's requests still moving, polled through the engine's handle table."""

    engine: NixlEngine
    pending: list[Any] = field(default_factory=list)  # nixl_xfer_handle
    reason: str | None = None  # set: FAILED at submission

    def poll(self) -> PollResult:
        return self.engine._progress(self)


class NixlEngine(HandleEngine):
    name = "nixl"

    def __init__(self, ctx: BackendContext) -> None:
        self.settings = NixlSettings.from_env(ctx.env or {})
        s = self.settings
        self.agent_name = (f"pdserve-{ctx.role}-{ctx.server_id or 'anon'}-r{ctx.rank}-"
                           f"{uuid.uuid4().hex[:8]}")
        config = nixl_agent_config(enable_prog_thread=s.progress == "thread",
                                   enable_listen_thread=False, backends=[])
        self._agent: Any = nixl_agent(self.agent_name, config)
        available = list(self._agent.get_plugin_list())
        self.backend = NixlSettings.resolve(s.backend, available)
        try:
            self._agent.create_backend(self.backend, dict(s.params))
        except NIXL_ERRORS as e:
            why = plugin_load_error(self.backend)
            self._agent = None
            raise ConfigError(
                f"NIXL could not create its {self.backend} backend (params {s.params}): "
                f"{describe_error(e, data_path=False)}" + (f"; {why}" if why else "") +
                f". Pick another plugin with SGLANG_DISAGGREGATION_NIXL_BACKEND "
                f"(available: {', '.join(available)})"
            ) from None
        mem_types = set(self._agent.get_backend_mem_types(self.backend))
        kinds = set()
        if "DRAM_SEG" in mem_types:
            kinds |= {MemoryKind.HOST, MemoryKind.SHM}
        if "VRAM_SEG" in mem_types:
            kinds.add(MemoryKind.CUDA)
        self.capabilities = Capabilities(memory_kinds=frozenset(kinds), needs_metadata=True)
        self._lock = threading.Lock()
        self._registered: dict[int, tuple[str, tuple[int, int, int, str]]] = {}
        self._local = RegionKinds([])
        self._peers: dict[str, RegionKinds] = {}
        self.handles = HandleTable("nixl")
        self._stop = threading.Event()
        self._pump: threading.Thread | None = None
        if s.progress == "pump":
            self._pump = threading.Thread(target=self._run_pump, name=f"pd-nixl-pump-{ctx.rank}",
                                          daemon=True)
            self._pump.start()
        log.info("nixl agent %s ready: backend %s %s, progress %s", self.agent_name, self.backend,
                 s.params or "", s.progress)

    def _live(self) -> Any:
        if self._agent is None:
            raise TransferError("nixl engine is closed; create a new one")
        return self._agent

    def _run_pump(self) -> None:
        while not self._stop.wait(self.settings.pump_interval_s):
            with self._lock:
                if self._agent is None:
                    return
                try:
                    self._agent.get_new_notifs()  # progresses the backend's workers
                except NIXL_ERRORS:
                    log.exception("nixl progress call failed")

    # -- memory ------------------------------------------------------------------------------
    def register(self, regions: Sequence[MemoryRegion]) -> None:
        with self._lock:
            agent = self._live()
            fresh = [r for r in regions if r.addr not in self._registered]
            by_mem: dict[str, list[tuple[int, int, int, str]]] = {}
            for r in fresh:
                if r.kind not in self.capabilities.memory_kinds:
                    raise TransferError(
                        f"NIXL {self.backend} cannot register {r.kind.value} memory "
                        f"({r.name or hex(r.addr)}); supported: "
                        f"{sorted(k.value for k in self.capabilities.memory_kinds)}")
                by_mem.setdefault(NIXL_MEM[r.kind], []).append((r.addr, r.length, r.device_id, ""))
            for mem, descs in by_mem.items():
                try:
                    agent.register_memory(agent.get_reg_descs(descs, mem), mem,
                                          backends=[self.backend])
                except NIXL_ERRORS as e:
                    raise TransferError(f"NIXL register_memory of {len(descs)} {mem} regions "
                                        f"failed: {describe_error(e)}") from None
                for d in descs:
                    self._registered[d[0]] = (mem, d)
            self._local = RegionKinds([r for r in self._local.regions if r.addr not in
                                       {f.addr for f in fresh}] + fresh)

    def deregister(self, regions: Sequence[MemoryRegion]) -> None:
        with self._lock:
            if self._agent is None:
                return
            gone = {r.addr for r in regions if r.addr in self._registered}
            self._deregister_locked(gone)
            self._local = RegionKinds([r for r in self._local.regions if r.addr not in gone])

    def _deregister_locked(self, addrs: set[int]) -> None:
        by_mem: dict[str, list[tuple[int, int, int, str]]] = {}
        for a in addrs:
            mem, desc = self._registered.pop(a)
            by_mem.setdefault(mem, []).append(desc)
        for mem, descs in by_mem.items():
            try:
                self._agent.deregister_memory(self._agent.get_reg_descs(descs, mem),
                                              backends=[self.backend])
            except NIXL_ERRORS as e:
                log.warning("NIXL deregister_memory failed: %s", describe_error(e))

    # -- peers -------------------------------------------------------------------------------
    def endpoint(self) -> bytes:
        with self._lock:
            return bytes(self._live().get_agent_metadata())

    def connect(self, peer_endpoint: bytes, peer_regions: Sequence[MemoryRegion]) -> Peer:
        with self._lock:
            agent = self._live()
            try:
                name = agent.add_remote_agent(bytes(peer_endpoint))
            except NIXL_ERRORS as e:
                raise TransferError(f"NIXL cannot load the peer's agent metadata: "
                                    f"{describe_error(e, data_path=False)} (the peer is gone, or "
                                    f"the bytes are not NIXL agent metadata)") from None
            name = name.decode() if isinstance(name, bytes) else str(name)
            by_mem: dict[str, list[tuple[int, int, int]]] = {}
            for r in peer_regions:
                by_mem.setdefault(NIXL_MEM.get(r.kind, "DRAM"), []).append(
                    (r.addr, r.length, r.device_id))
            for mem, descs in by_mem.items():  # the metadata must cover every region it sent
                try:
                    agent.prep_xfer_dlist(name, descs, mem, backends=[self.backend]).release()
                except NIXL_ERRORS as e:
                    raise TransferError(f"NIXL peer agent {name!r} does not expose the {mem} "
                                        f"regions it announced: {describe_error(e)}") from None
            self._peers[name] = RegionKinds(peer_regions)
        return Peer(endpoint=bytes(peer_endpoint), key=name, state=self._peers[name])

    def disconnect(self, peer: Peer) -> None:
        with self._lock:
            if self._agent is None or self._peers.pop(peer.key, None) is None:
                return
            try:
                self._agent.remove_remote_agent(peer.key)
            except NIXL_ERRORS as e:
                log.warning("NIXL remove_remote_agent(%s) failed: %s", peer.key, describe_error(e))

    # -- data --------------------------------------------------------------------------------
    def write(self, peer: Peer, batch: CopyBatch) -> int:
        n = len(batch)
        with self._lock:
            agent = self._live()
            if n == 0:
                return self.handles.add(DONE)
            remote = peer.state if isinstance(peer.state, RegionKinds) else RegionKinds([])
            src = np.asarray(batch.src, dtype=np.uint64)
            dst = np.asarray(batch.dst, dtype=np.uint64)
            length = np.asarray(batch.length, dtype=np.uint64)
            lmem, ldev = self._local.lookup(src)
            rmem, rdev = remote.lookup(dst)
            pair = lmem * len(MEM_NAMES) + rmem
            transfer = _Transfer(self)
            try:
                codes = np.unique(pair)
                for code in codes:
                    idx = np.flatnonzero(pair == code) if len(codes) > 1 else slice(None)
                    lm, rm = MEM_NAMES[int(code) // len(MEM_NAMES)], MEM_NAMES[int(code) % len(MEM_NAMES)]
                    local_d = agent.get_xfer_descs(np.stack([src[idx], length[idx], ldev[idx]], 1), lm)
                    remote_d = agent.get_xfer_descs(np.stack([dst[idx], length[idx], rdev[idx]], 1), rm)
                    xfer = agent.initialize_xfer("WRITE", local_d, remote_d, peer.key,
                                                 backends=[self.backend])
                    transfer.pending.append(xfer)
                    if agent.transfer(xfer) == "ERR":
                        raise TransferError("transfer() returned ERR")
            except NIXL_ERRORS as e:
                self._release_locked(transfer.pending)
                transfer.pending = []
                transfer.reason = (f"NIXL WRITE of {n} copies to agent {peer.key!r} failed: "
                                   f"{describe_error(e)}")
            return self.handles.add(transfer)

    def _progress(self, transfer: _Transfer) -> PollResult:
        """Check the transfer's NIXL requests; DONE or FAILED once none is moving (releasing
        every request), else PENDING."""
        with self._lock:
            if self._agent is None:
                return failed("nixl engine was closed while the write was in flight")
            if transfer.reason is None and transfer.pending:
                try:
                    still = []
                    for xfer in transfer.pending:
                        state = self._agent.check_xfer_state(xfer)
                        if state == "ERR":
                            raise TransferError("check_xfer_state returned ERR")
                        if state == "PROC":
                            still.append(xfer)
                        else:
                            self._release_locked([xfer])
                    transfer.pending = still
                except NIXL_ERRORS as e:
                    transfer.reason = f"NIXL WRITE failed: {describe_error(e)}"
                if transfer.reason is None and transfer.pending:
                    return PENDING
            self._release_locked(transfer.pending)
            transfer.pending = []
        return DONE if transfer.reason is None else failed(transfer.reason)

    def _release_locked(self, xfers: list[Any]) -> None:
        for xfer in xfers:
            try:
                self._agent.release_xfer_handle(xfer)
            except NIXL_ERRORS as e:  # an active request NIXL could not cancel
                log.warning("NIXL could not release a transfer request: %s", describe_error(e))

    def close(self) -> None:
        with self._lock:
            if self._agent is None:
                return
            self._stop.set()
        if self._pump is not None:
            self._pump.join(5.0)
        with self._lock:
            for transfer in self.handles.drain():
                if isinstance(transfer, _Transfer):
                    self._release_locked(transfer.pending)
            for name in list(self._peers):
                try:
                    self._agent.remove_remote_agent(name)
                except NIXL_ERRORS as e:
                    log.warning("NIXL remove_remote_agent(%s) failed: %s", name, describe_error(e))
            self._peers.clear()
            self._deregister_locked(set(self._registered))
            self._agent = None


def create(ctx: BackendContext) -> NixlEngine:
    return NixlEngine(ctx)
