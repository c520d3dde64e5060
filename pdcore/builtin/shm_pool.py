"""`shm` memory pool: a server's KV and aux buffers in named POSIX shared memory.

Lifecycle:
1. `ShmMemoryPool(ctx)` removes stale `pdserve_*` segments of dead processes (crash clean-up);
2. `allocate(label, shape, dtype)` creates `/dev/shm/pdserve_{server_id}_{pid}_{label}`,
   page-aligned and zero-filled, and returns the tensor over it plus an SHM MemoryRegion
   (segment name, offset 0) that a same-host peer maps to write into;
3. `close()` (or garbage collection / interpreter exit) unlinks every segment; memory stays
   valid for tensors still alive and is unmapped when the last of them is freed.
"""

from __future__ import annotations

import logging
import math
import os
import uuid
import weakref
from collections.abc import Sequence

import torch

from pdcore.builtin import shm_segment as seg
from pdcore.errors import ConfigError
from pdcore.interfaces.memory import Buffer, MemoryPool, PoolContext
from pdcore.interfaces.transfer import MemoryKind, MemoryRegion

log = logging.getLogger(__name__)


def _unlink_all(names: list[str]) -> None:
    for name in names:
        try:
            seg.unlink(name)
        except OSError as e:  # at exit there is no one left to tell but the log
            log.warning("could not remove shared-memory segment %s: %s", name, e)
    names.clear()


class ShmMemoryPool(MemoryPool):
    name = "shm"

    def __init__(self, ctx: PoolContext) -> None:
        if torch.device(ctx.device).type != "cpu":
            raise ConfigError(
                f"the shm memory pool holds host memory; device {ctx.device!r} is not supported. "
                f"Use the platform's default pool for accelerator memory"
            )
        self.ctx = ctx
        self.server_id = ctx.server_id or uuid.uuid4().hex[:12]
        self.pid = os.getpid()
        self.removed_stale = seg.clean_stale()
        self._names: list[str] = []  # shared with the finalizer, which unlinks what is left
        self._maps: dict[str, object] = {}
        self._buffers: dict[str, Buffer] = {}
        self._closed = False
        self._finalizer = weakref.finalize(self, _unlink_all, self._names)

    def allocate(self, label: str, shape: Sequence[int], dtype: torch.dtype) -> Buffer:
        if self._closed:
            raise ConfigError("shm pool is closed; create a new one")
        if label in self._buffers:
            raise ValueError(f"shm pool: label {label!r} already allocated")
        shape = tuple(int(s) for s in shape)
        numel = math.prod(shape)
        if numel <= 0 or any(s < 0 for s in shape):
            raise ValueError(f"shm pool: shape {shape} of {label!r} must hold at least one element")
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        name = seg.segment_name(self.server_id, self.pid, label)
        if name in self._maps:
            raise ValueError(f"shm pool: labels must stay distinct after cleaning: {label!r} "
                             f"maps to segment {name} already in use")
        try:
            mm = seg.create(name, seg.round_up(nbytes))
        except seg.NoSpace as e:
            raise ConfigError(
                f"shm pool: cannot allocate {label!r}: {e.strerror}. Give the container a "
                f"bigger /dev/shm (docker --shm-size), lower --max-total-tokens / "
                f"--mem-fraction-static, or use another memory pool") from None
        self._names.append(name)
        tensor = torch.frombuffer(mm, dtype=dtype, count=numel).view(shape)
        region = MemoryRegion(addr=tensor.data_ptr(), length=nbytes, kind=MemoryKind.SHM,
                              device_id=0, name=name, offset=0)
        self._maps[name] = mm
        buf = Buffer(tensor=tensor, region=region)
        self._buffers[label] = buf
        return buf

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        _unlink_all(self._names)
        # Never mmap.close() here: torch.frombuffer keeps a reference to the mmap object but no
        # buffer export, so close() would unmap memory under live tensors (a segfault later).
        # Dropping our references unmaps each segment when its last tensor is gone.
        self._buffers.clear()
        self._maps.clear()
        self._finalizer.detach()
