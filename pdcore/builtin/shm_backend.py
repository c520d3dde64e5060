"""`shm` transfer engine: same-host copies straight into the peer's KV pool.

Two ways into the peer, chosen by the peer's memory pool (PDCORE_SHM_MODE picks the pool, see
`preferred_pool`):
- segment mode: the peer's KV lives in named POSIX shared memory (`shm` pool); this engine maps
  the segments and copies into the mapping (shm_copy.pick: process_vm_writev on itself, or
  ctypes.memmove);
- cma mode: the peer's KV is private host memory (`thp` pool: 2 MiB pages); this engine writes
  into the peer's address space with process_vm_writev(peer pid) (cross-memory attach). Nothing
  is mapped, so nothing can leak. Before every copy the peer's identity nonce is read back from
  the address its endpoint published: a pid that exited, or was reused by another process, fails
  the copy instead of writing into a stranger. Needs the same pid namespace and ptrace access
  (same user; Yama ptrace_scope 0 or CAP_SYS_PTRACE); connect() probes it.
Why two: with THP in `madvise` mode and shmem huge pages off (this machine), a shared segment is
4 KiB pages and copies into it run at about half the speed of copies into huge pages.

Lifecycle:
1. `ShmTransferEngine(ctx)`: removes segments of dead pdserve processes; host identity
   (hostname + boot id, or PDCORE_HOST_ID from ctx.env), a worker pool of ctx.thread_pool_size
   threads, an empty "engine alive" marker segment that close() removes (peers also notice a
   closed, not only a dead, engine), and the identity nonce;
2. `register(regions)`: local memory write() may read from (host or shm);
3. `endpoint()`: JSON {host_id, pid, pid namespace, marker, nonce address and value};
4. `connect(endpoint, peer_regions)`: refuses a peer on another host identity BEFORE touching
   anything; maps each of the peer's SHM segments read-write (once per segment), or, when the
   peer has host regions only, probes cross-memory attach;
5. `write(peer, batch)`: checks src against local and dst against the peer's regions, checks
   the peer is alive, orders the items by destination address and builds their iovec arrays
   once, then workers copy chunks of about equal bytes in parallel; `poll()` -> PENDING /
   DONE / FAILED(reason);
6. peer loss (its process exited, its engine closed, a segment was removed or replaced, its
   nonce is gone) fails the write and unmaps the peer once no copy is using the mapping;
   `disconnect` / `close()` unmap too.
"""

from __future__ import annotations

import errno
import json
import os
import threading
import time
import uuid
import weakref
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from pdcore.backendkit import (
    HandleEngine,
    HandleTable,
    RegionIndex,
    SharedExclusive,
    batch_arrays,
    read_timeout,
)
from pdcore.backendkit.parallel import join_futures, split_by_bytes
from pdcore.builtin import shm_copy
from pdcore.builtin import shm_segment as seg
from pdcore.errors import ConfigError, TransferError
from pdcore.interfaces.transfer import (
    DONE,
    BackendContext,
    Capabilities,
    CopyBatch,
    MemoryKind,
    MemoryRegion,
    Peer,
    PollResult,
    failed,
)

TIMEOUT_ENV = "PDCORE_SHM_TIMEOUT"
MODE_ENV = "PDCORE_SHM_MODE"
MODES = ("auto", "cma", "segment")
NONCE_BYTES = 16
# Below this many bytes a batch is copied by one worker: splitting costs more than it gains.
CHUNK_BYTES = 8 << 20
LIVENESS_EVERY = 0.5  # seconds between checks that the peer's segments are still its own


@dataclass(eq=False)
class _ShmPeer:
    label: str
    pid: int
    same_pidns: bool
    marker: str
    maps: list[seg.Mapped]
    index: RegionIndex  # the peer's SHM regions (peer addresses)
    bases: np.ndarray  # per index region: local address of its first byte
    nonce: tuple[int, bytes] | None = None  # cma mode: (address in the peer, expected bytes)
    guard: SharedExclusive = field(default_factory=SharedExclusive)
    lost: str = ""
    unmapped: bool = False
    checked_at: float = 0.0


class ShmTransferEngine(HandleEngine):
    name = "shm"
    capabilities = Capabilities(memory_kinds=frozenset({MemoryKind.SHM, MemoryKind.HOST}),
                                same_host_only=True)

    def __init__(self, ctx: BackendContext) -> None:
        self.ctx = ctx
        self.host_id = seg.host_identity(dict(ctx.env))
        self.timeout = read_timeout(ctx.env, TIMEOUT_ENV, 30.0)
        self.workers = max(1, ctx.thread_pool_size)
        self.chunk_bytes = CHUNK_BYTES
        self.copy_strategy, self._copy_items = shm_copy.pick(ctx.env.get(shm_copy.COPY_ENV, ""))
        self._local = RegionIndex(())
        self._local_guard = SharedExclusive()  # deregister waits for copies reading it
        self._generation = 0  # bumped by deregister: copies queued before it do not run
        self.handles = HandleTable("shm")
        self._lock = threading.Lock()
        self._peers: set[_ShmPeer] = set()
        self._closed = False
        self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="shm-copy")
        # Markers of dead engines (and, in cma mode where no shm pool runs, any segment of a
        # dead pdserve process) go first: each engine start is a clean-up point.
        self.removed_stale = seg.clean_stale()
        self._marker = seg.segment_name(ctx.server_id or "shm", os.getpid(),
                                        f"engine-r{ctx.rank}-{uuid.uuid4().hex[:8]}")
        os.close(os.open(seg.path_of(self._marker), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
        self._finalizer = weakref.finalize(self, seg.unlink, self._marker)
        # What a cma-mode peer reads back before each copy into us (see the module docstring).
        self._nonce = np.frombuffer(os.urandom(NONCE_BYTES), dtype=np.uint8).copy()

    # -- memory --------------------------------------------------------------------------------
    def register(self, regions: Sequence[MemoryRegion]) -> None:
        self._check_open()
        for r in regions:
            if r.kind not in self.capabilities.memory_kinds:
                raise TransferError(f"shm backend cannot read {r.kind.value} memory (region "
                                    f"{r.name or hex(r.addr)}); use a host or shm memory pool")
        self._local = RegionIndex(self._local.regions + tuple(regions))

    def deregister(self, regions: Sequence[MemoryRegion]) -> None:
        gone = {(r.addr, r.length) for r in regions}
        if not self._local_guard.acquire_exclusive(self.timeout):
            raise TransferError(f"shm: deregister timed out after {self.timeout}s waiting for "
                                f"in-flight copies to finish")
        try:
            self._local = RegionIndex(
                [r for r in self._local.regions if (r.addr, r.length) not in gone])
            self._generation += 1
        finally:
            self._local_guard.release_exclusive()

    # -- peers ---------------------------------------------------------------------------------
    def endpoint(self) -> bytes:
        return json.dumps({"backend": "shm", "host_id": self.host_id, "pid": os.getpid(),
                           "pidns": seg.pid_namespace(), "marker": self._marker,
                           "nonce_addr": self._nonce.ctypes.data,
                           "nonce": self._nonce.tobytes().hex()}).encode()

    def connect(self, peer_endpoint: bytes, peer_regions: Sequence[MemoryRegion]) -> Peer:
        self._check_open()
        try:
            info = json.loads(bytes(peer_endpoint).decode())
            host_id, pid = str(info["host_id"]), int(info["pid"])
            pidns, marker = str(info.get("pidns", "")), str(info.get("marker", ""))
            if marker:
                seg.path_of(marker)  # a plain segment name, never a path
            nonce = (int(info["nonce_addr"]), bytes.fromhex(info["nonce"])) \
                if "nonce" in info else None
            if nonce is not None and len(nonce[1]) != NONCE_BYTES:
                raise ValueError(f"nonce must be {NONCE_BYTES} bytes")
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
            raise TransferError(f"shm: malformed peer endpoint {bytes(peer_endpoint)[:200]!r} "
                                f"({e}); expected ShmTransferEngine.endpoint() JSON") from None
        label = f"{host_id} pid {pid}"
        if host_id != self.host_id:
            raise TransferError(
                f"shm: peer pid {pid} is on host {host_id!r}, this engine on {self.host_id!r}; "
                f"the shm backend only connects processes on the same host. Use --backend tcp "
                f"(or an RDMA backend) between hosts")
        if marker and not os.path.exists(seg.path_of(marker)):
            raise TransferError(f"shm: peer {label} has closed its engine (marker {marker} is "
                                f"gone); reconnect with its current endpoint")
        wanted = [r for r in peer_regions if r.kind is MemoryKind.SHM and r.name]
        if not wanted:
            return self._connect_cma(peer_endpoint, label, pid, pidns, marker, nonce,
                                     regions=[r for r in peer_regions if r.kind is MemoryKind.HOST])
        for r in wanted:
            # Only pdserve segments of that very process: a bad endpoint can never make this
            # process map (and later write into) somebody else's shared memory.
            if seg.owner_pid(r.name) != pid:
                raise TransferError(f"shm: peer region {r.name!r} is not a pdserve segment of "
                                    f"peer pid {pid}; refusing to map it")
        maps: dict[str, seg.Mapped] = {}
        try:
            for r in wanted:
                if r.name not in maps:
                    maps[r.name] = seg.map_existing(r.name)
                m = maps[r.name]
                if r.offset < 0 or r.length < 0 or r.offset + r.length > m.size:
                    raise TransferError(f"shm: peer region {r.name}+{r.offset} ({r.length} bytes) "
                                        f"does not fit its {m.size}-byte segment")
        except (OSError, ValueError) as e:
            self._unmap(list(maps.values()))
            raise TransferError(f"shm: cannot map peer {label}'s segment: {e}; is the peer alive "
                                f"and on this host?") from None
        except TransferError:
            self._unmap(list(maps.values()))
            raise
        index = RegionIndex(wanted)
        bases = np.array([maps[r.name].addr + r.offset for r in index.regions], dtype=np.uint64)
        state = _ShmPeer(label, pid, pidns == seg.pid_namespace(), marker, list(maps.values()),
                         index, bases, checked_at=time.monotonic())
        return self._add_peer(peer_endpoint, state)

    def _connect_cma(self, peer_endpoint: bytes, label: str, pid: int, pidns: str, marker: str,
                     nonce: tuple[int, bytes] | None, *, regions: list[MemoryRegion]) -> Peer:
        """The peer's KV is private host memory: write into it with process_vm_writev."""
        fix = (f"start every server with the shm memory pool ({MODE_ENV}=segment or "
               f"--memory-pool shm) or use another backend")
        if not regions:
            raise TransferError(f"shm: peer {label} registered no host or shared-memory "
                                f"regions; {fix}")
        if nonce is None or pidns != seg.pid_namespace():
            raise TransferError(f"shm: peer {label}'s memory is not shared memory and it cannot "
                                f"be written across processes from here (its engine is older or "
                                f"in another pid namespace); {fix}")
        ok, why = shm_copy.cma_permitted()
        why = why if not ok else self._identity_problem(pid, nonce)
        if why:
            raise TransferError(f"shm: cannot write into peer {label}'s private memory: {why}; "
                                f"{fix}")
        index = RegionIndex(regions)
        bases = np.array([r.addr for r in index.regions], dtype=np.uint64)
        state = _ShmPeer(label, pid, True, marker, [], index, bases, nonce=nonce,
                         checked_at=time.monotonic())
        return self._add_peer(peer_endpoint, state)

    @staticmethod
    def _identity_problem(pid: int, nonce: tuple[int, bytes]) -> str:
        """'' when process `pid` still holds our peer's nonce where it published it."""
        try:
            got = shm_copy.read_word(pid, nonce[0], len(nonce[1]))
        except OSError as e:
            what = {errno.ESRCH: "the process exited", errno.EPERM: "no ptrace access to it",
                    errno.EFAULT: "its pid now belongs to another process"}
            return f"{what.get(e.errno, 'reading its identity failed')} ({e.strerror})"
        return "" if got == nonce[1] else "its pid now belongs to another process"

    def _add_peer(self, peer_endpoint: bytes, state: _ShmPeer) -> Peer:
        with self._lock:
            if self._closed:
                self._unmap(state.maps)
                raise TransferError("shm: engine is closed; create a new one")
            self._peers.add(state)
        return Peer(endpoint=bytes(peer_endpoint), key=state.label, state=state)

    def disconnect(self, peer: Peer) -> None:
        state: _ShmPeer = peer.state
        with self._lock:
            self._peers.discard(state)
        self._release(state, "disconnected", self.timeout)

    def _release(self, state: _ShmPeer, why: str, timeout: float) -> bool:
        """Unmap once no copy uses the mapping. False if copies still run after `timeout`."""
        state.lost = state.lost or why
        if not state.guard.acquire_exclusive(timeout):
            return False
        try:
            if not state.unmapped:
                state.unmapped = True
                self._unmap(state.maps)
        finally:
            state.guard.release_exclusive()
        return True

    @staticmethod
    def _unmap(maps: list[seg.Mapped]) -> None:
        for m in maps:
            m.mm.close()

    def _alive(self, state: _ShmPeer) -> str:
        """Why the peer is gone, or ''. Segment identity is re-checked every LIVENESS_EVERY s."""
        # (cma mode: every copy first reads the peer's nonce back, which also catches an exit)
        if state.nonce is None and state.same_pidns and not seg.pid_alive(state.pid):
            return f"peer process {state.pid} exited"
        if state.marker and not os.path.exists(seg.path_of(state.marker)):
            return "peer engine closed"
        now = time.monotonic()
        if now - state.checked_at >= LIVENESS_EVERY:
            state.checked_at = now
            for m in state.maps:
                if not seg.still_there(m):
                    return f"peer segment {m.name} was removed or replaced"
        return ""

    # -- transfers -----------------------------------------------------------------------------
    def write(self, peer: Peer, batch: CopyBatch) -> int:
        self._check_open()
        state: _ShmPeer = peer.state
        why = state.lost or self._alive(state)
        if why:
            if not state.lost:
                # Unmap in the background: a copy still running must finish first.
                state.lost = why
                self._pool.submit(self._release, state, why, self.timeout)
            return self.handles.add(failed(f"shm: peer {state.label} lost ({why}); nothing "
                                            f"was copied. Reconnect after it re-registers"))
        n = len(batch)
        if n == 0:
            return self.handles.add(DONE)
        src, dst, length = batch_arrays(batch)
        if bad := self._local.outside("src", src, length)[1]:
            return self.handles.add(failed(f"shm: {bad} is not inside memory registered with "
                                            f"this engine; register() it first. Nothing was "
                                            f"copied"))
        didx, bad = state.index.outside("dst", dst, length)
        if bad:
            return self.handles.add(failed(f"shm: {bad} is outside the shared-memory regions of "
                                            f"peer {state.label}; nothing was copied"))
        local_dst = dst - state.index.starts[didx] + state.bases[didx]
        # In ascending destination order: neighbouring pages of one KV buffer then share huge
        # pages, TLB entries and page-table cache lines (5-25% faster here than the plan's
        # order once the caches are cold). Items never overlap, so their order is free.
        order = np.argsort(local_dst)
        local_iov, remote_iov = shm_copy.iovecs(local_dst[order], src[order], length[order])
        chunks = split_by_bytes(local_iov[:, 1], self.workers, self.chunk_bytes)
        gen = self._generation
        futures = [self._pool.submit(self._copy, state, local_iov[a:b], remote_iov[a:b], gen)
                   for a, b in chunks]
        if len(futures) == 1:
            return self.handles.add(futures[0])
        return self.handles.add(join_futures(futures, failed("shm: engine closed before the "
                                                              "copy ran")))

    def _copy(self, state: _ShmPeer, local_iov: np.ndarray, remote_iov: np.ndarray,
              generation: int) -> PollResult:
        if not state.guard.acquire_shared(self.timeout):
            return failed(f"shm: peer {state.label} is being unmapped")
        if not self._local_guard.acquire_shared(self.timeout):
            state.guard.release_shared()
            return failed("shm: local memory is being deregistered; nothing copied")
        try:
            if state.unmapped:
                return failed(f"shm: peer {state.label} lost ({state.lost}); nothing copied")
            if generation != self._generation:
                return failed("shm: local memory was deregistered while the batch was queued; "
                              "nothing copied")
            if state.nonce is None:
                self._copy_items(local_iov, remote_iov)  # outside the GIL: chunks overlap
            elif why := self._identity_problem(state.pid, state.nonce):
                state.lost = state.lost or why
                return failed(f"shm: peer {state.label} lost ({why}); nothing copied")
            else:
                shm_copy.writev(local_iov, remote_iov, pid=state.pid)
        except OSError as e:
            return failed(f"shm: copying into peer {state.label} failed: {e}")
        finally:
            self._local_guard.release_shared()
            state.guard.release_shared()
        return DONE

    # -- shutdown ------------------------------------------------------------------------------
    def close(self) -> None:
        if not self._mark_closed():
            return
        with self._lock:  # _add_peer adds none once _closed is set
            peers, self._peers = list(self._peers), set()
        self._pool.shutdown(wait=True, cancel_futures=True)
        for p in peers:
            self._release(p, "engine closed", self.timeout)
        self._finalizer()  # removes the alive marker


def preferred_pool(env: Mapping[str, str]) -> str:
    """The memory pool servers using this backend allocate their KV from, by PDCORE_SHM_MODE:
    `segment` -> `shm` (POSIX shared memory); `cma` -> `thp` (private, huge pages; error where
    cross-memory attach is not permitted); unset / `auto` -> `thp` where permitted, else `shm`.
    Every server of one deployment should resolve the same way (a peer adapts to whichever pool
    the other side has, but a `thp` peer is only reachable where cma is permitted)."""
    mode = (env.get(MODE_ENV, "") or "auto").strip().lower()
    if mode not in MODES:
        raise ConfigError(f"{MODE_ENV} must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "segment":
        return "shm"
    ok, why = shm_copy.cma_permitted()
    if mode == "cma" and not ok:
        raise ConfigError(f"{MODE_ENV}=cma but {why}; use {MODE_ENV}=segment")
    return "thp" if ok else "shm"
