"""Transfer backend contract: a thin data mover between registered memory regions.

The core owns the protocol (bootstrap, control plane, states, timeouts, aborts, page-run
planning, bounds checks). A backend only:

1. registers memory regions it may read from or write into (`register`);
2. exposes an `endpoint()` blob a peer uses to reach it (exchanged by the core's control plane);
3. `connect(peer_endpoint, peer_regions)` -> Peer (peer_regions: what the peer registered);
4. `write(peer, CopyBatch)` -> Handle, asynchronous, one batch;
5. `poll(handle)` -> PollResult(PENDING | DONE | FAILED, reason); DONE/FAILED release the handle;
   `wait(handle, timeout)` blocks until DONE/FAILED (FAILED 'timed out' leaves it pending);
6. `close()` frees everything (idempotent).

An unknown handle (never issued by this engine, or already reported DONE/FAILED by an earlier
poll or wait) is answered FAILED, with a reason that names the handle: poll() and wait() never
raise for it and never answer PENDING. Why FAILED rather than an exception: FAILED is the one
answer every caller already handles (the core's sender turns it into a failed decode session and
failed rooms, pages freed, the reason reported), so a caller's bookkeeping slip (a retry path that
polls twice) takes the path every other failure takes and stays inside the rooms it concerns; an
exception is a second error path whose type the contract would have to fix (the backends that
raised used TransferError, a dict lookup raises KeyError), and PENDING would leave the caller
waiting until its timeout. `pdcore.backendkit.HandleTable` keeps this rule for a backend.

A factory registered through `pd_register_transfer_backends` receives a BackendContext.
"""

from __future__ import annotations

import enum
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np


class MemoryKind(str, enum.Enum):
    HOST = "host"  # ordinary (or pinned) process memory
    SHM = "shm"  # named POSIX shared memory; MemoryRegion.name is the segment name
    CUDA = "cuda"
    NPU = "npu"


@dataclass(frozen=True, slots=True)
class MemoryRegion:
    """A contiguous byte range the engine may read from or write into."""

    addr: int
    length: int
    kind: MemoryKind = MemoryKind.HOST
    device_id: int = 0
    name: str = ""  # shm segment name, or a label for logs
    offset: int = 0  # byte offset of `addr` inside the named segment (shm)

    @property
    def end(self) -> int:
        return self.addr + self.length

    def to_dict(self) -> dict[str, Any]:
        return {
            "addr": self.addr,
            "length": self.length,
            "kind": self.kind.value,
            "device_id": self.device_id,
            "name": self.name,
            "offset": self.offset,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> MemoryRegion:
        return cls(
            addr=int(d["addr"]),
            length=int(d["length"]),
            kind=MemoryKind(d.get("kind", "host")),
            device_id=int(d.get("device_id", 0)),
            name=str(d.get("name", "")),
            offset=int(d.get("offset", 0)),
        )


@dataclass(frozen=True, slots=True)
class Capabilities:
    memory_kinds: frozenset[MemoryKind] = frozenset({MemoryKind.HOST})
    max_batch: int = 1 << 20  # most copies one write() may carry; the core splits larger batches
    needs_metadata: bool = False  # endpoint() is a metadata blob, not just an address
    same_host_only: bool = False
    moves_data: bool = True  # False for `fake`


@dataclass(frozen=True, slots=True)
class CopyBatch:
    """One batch of copies: three equal-length uint64 arrays of absolute addresses/lengths."""

    src: np.ndarray
    dst: np.ndarray
    length: np.ndarray

    def __post_init__(self) -> None:
        if not (len(self.src) == len(self.dst) == len(self.length)):
            raise ValueError("CopyBatch arrays must have equal length")

    def __len__(self) -> int:
        return len(self.src)

    @property
    def nbytes(self) -> int:
        return int(self.length.sum()) if len(self.length) else 0

    @classmethod
    def empty(cls) -> CopyBatch:
        z = np.zeros(0, dtype=np.uint64)
        return cls(z, z, z)

    def split(self, max_items: int) -> list[CopyBatch]:
        n = len(self)
        if n <= max_items:
            return [self]
        return [
            CopyBatch(self.src[i : i + max_items], self.dst[i : i + max_items],
                      self.length[i : i + max_items])
            for i in range(0, n, max_items)
        ]


class TransferStatus(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class PollResult:
    status: TransferStatus
    reason: str = ""


PENDING = PollResult(TransferStatus.PENDING)
DONE = PollResult(TransferStatus.DONE)


def failed(reason: str) -> PollResult:
    return PollResult(TransferStatus.FAILED, reason)


def wait_by_polling(poll: Callable[[int], PollResult], handle: int,
                    timeout: float) -> PollResult:
    """poll(handle) until it is not PENDING, at most `timeout` seconds (then FAILED 'timed out';
    the handle stays pending). Backs off from 50 us to 2 ms between polls: cheap on a busy
    host, but it can notice a finished copy up to 2 ms late."""
    deadline = time.monotonic() + timeout
    delay = 5e-5
    while True:
        r = poll(handle)
        if r.status is not TransferStatus.PENDING:
            return r
        left = deadline - time.monotonic()
        if left <= 0:
            return failed(f"timed out after {timeout:g}s")
        time.sleep(min(delay, left))
        delay = min(delay * 2, 2e-3)


@dataclass(frozen=True, slots=True)
class BackendContext:
    """What a backend factory gets: who it serves and its settings (already parsed)."""

    role: str = "null"  # "prefill" | "decode" | "null"
    rank: int = 0
    tp_size: int = 1
    device: str = "cpu"
    gpu_id: int = 0
    host: str = "127.0.0.1"
    server_id: str = ""  # unique per server process; pools and shm segments derive names from it
    ib_device: str | None = None
    thread_pool_size: int = 4
    queue_size: int = 4
    env: Mapping[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class Peer:
    """A connected peer. `state` is the backend's own (socket, session id, agent name...)."""

    endpoint: bytes
    key: str
    state: Any = None


class TransferEngine(ABC):
    """Moves bytes from local registered memory into a peer's registered memory."""

    name: str = ""
    capabilities: Capabilities = Capabilities()

    @abstractmethod
    def register(self, regions: Sequence[MemoryRegion]) -> None:
        """Register local regions (all at once). Writes may only touch registered memory."""

    def deregister(self, regions: Sequence[MemoryRegion]) -> None:
        """Forget regions (default: nothing to undo)."""

    @abstractmethod
    def endpoint(self) -> bytes:
        """What a peer needs to reach this engine (address or metadata blob)."""

    @abstractmethod
    def connect(self, peer_endpoint: bytes, peer_regions: Sequence[MemoryRegion]) -> Peer:
        """Prepare to write into a peer. Raises TransferError when the peer is unusable."""

    def disconnect(self, peer: Peer) -> None:
        """Drop a peer (it died or re-registered)."""

    @abstractmethod
    def write(self, peer: Peer, batch: CopyBatch) -> int:
        """Start copying batch (local src -> peer dst). Returns a handle for poll()."""

    @abstractmethod
    def poll(self, handle: int) -> PollResult:
        """PENDING, DONE or FAILED(reason). DONE and FAILED release the handle; an unknown
        handle is FAILED with a reason naming it, never an exception."""

    @abstractmethod
    def close(self) -> None:
        """Release everything; idempotent."""

    def wait(self, handle: int, timeout: float = 30.0) -> PollResult:
        """Block until the handle is DONE or FAILED, at most `timeout` seconds (then FAILED
        'timed out'; the handle stays pending). An unknown handle is FAILED at once (see the
        module docstring). The core's sender waits for its writes here. This default polls
        (`wait_by_polling`); a backend whose copies finish on its own threads overrides it to
        wake on completion."""
        return wait_by_polling(self.poll, handle, timeout)
