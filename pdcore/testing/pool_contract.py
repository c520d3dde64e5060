"""Contract suite for memory pools.

    from pdcore.testing.pool_contract import PoolContract

    class TestMyPool(PoolContract):
        pool_name = "mypool"                 # or override make_pool()

Checks: buffers of several shapes and dtypes come back contiguous, zero-filled, on the context's
device; each region's addr/length are exactly the tensor's memory (for host-addressable kinds
this is verified by reading and writing through the address); regions never overlap; a
duplicate label is refused; close() is idempotent. A pool unavailable here is skipped with its
reason.
"""

from __future__ import annotations

import ctypes
import itertools
import uuid
from collections.abc import Iterator

import pytest
import torch

from pdcore.errors import PDError
from pdcore.interfaces.memory import Buffer, MemoryPool, PoolContext
from pdcore.interfaces.transfer import MemoryKind
from pdcore.plugins.host import memory_pools

SHAPES: tuple[tuple[tuple[int, ...], torch.dtype], ...] = (
    ((4, 16), torch.float32),
    ((2, 3, 5), torch.float16),
    ((7,), torch.bfloat16),
    ((3, 8, 2, 4), torch.int8),
    ((4097,), torch.uint8),
    ((5, 3), torch.int64),
    ((2, 64, 4, 8), torch.float32),  # a KV page buffer: [pages, page_size, heads, head_dim]
)
HOST_KINDS = (MemoryKind.HOST, MemoryKind.SHM)


class PoolContract:
    pool_name: str = ""
    device: str = "cpu"

    def make_context(self) -> PoolContext:
        return PoolContext(server_id=f"contract-{uuid.uuid4().hex[:8]}", device=self.device)

    def make_pool(self) -> MemoryPool:
        entry = memory_pools().get(self.pool_name)
        ok, reason = entry.available()
        if not ok:
            pytest.skip(f"memory pool {self.pool_name!r} is unavailable here: {reason}")
        return memory_pools().create(self.pool_name, self.make_context())

    @pytest.fixture
    def pool(self) -> Iterator[MemoryPool]:
        pool = self.make_pool()
        try:
            yield pool
        finally:
            pool.close()

    def allocate_all(self, pool: MemoryPool) -> list[Buffer]:
        return [pool.allocate(f"buf-{i}", shape, dtype) for i, (shape, dtype) in enumerate(SHAPES)]

    def test_is_memory_pool(self, pool: MemoryPool) -> None:
        assert isinstance(pool, MemoryPool)

    def test_buffers_zero_filled_with_shape_and_dtype(self, pool: MemoryPool) -> None:
        expected_type = torch.device(self.device).type
        for buf, (shape, dtype) in zip(self.allocate_all(pool), SHAPES, strict=True):
            t = buf.tensor
            assert tuple(t.shape) == shape and t.dtype == dtype, (t.shape, t.dtype, shape, dtype)
            assert t.is_contiguous()
            assert t.device.type == expected_type, f"{t.device} is not a {self.device} device"
            assert not t.reshape(-1).view(torch.uint8).any(), f"{shape} {dtype} is not zeroed"

    def test_region_matches_tensor(self, pool: MemoryPool) -> None:
        buffers = self.allocate_all(pool)
        for buf in buffers:
            t, r = buf.tensor, buf.region
            assert r.addr == t.data_ptr(), "region.addr must be tensor.data_ptr()"
            assert r.length == t.numel() * t.element_size()
            if t.device.type == "cpu":
                assert r.kind in HOST_KINDS, f"host tensor described as {r.kind}"
            else:
                assert r.kind not in HOST_KINDS, f"{t.device} tensor described as {r.kind}"
        spans = sorted((b.region.addr, b.region.end) for b in buffers)
        for (_, end), (start, _) in itertools.pairwise(spans):
            assert end <= start, "two buffers' regions overlap"

    def test_region_address_is_the_tensor_memory(self, pool: MemoryPool) -> None:
        buf = pool.allocate("probe", (1024,), torch.uint8)
        if buf.region.kind not in HOST_KINDS:
            pytest.skip("device memory is not addressable from the host")
        buf.tensor.copy_(torch.arange(1024, dtype=torch.int64).remainder(251).to(torch.uint8))
        assert ctypes.string_at(buf.region.addr, 1024) == buf.tensor.numpy().tobytes()
        ctypes.memmove(buf.region.addr + 10, b"\xaa\xbb", 2)
        assert buf.tensor[10].item() == 0xAA and buf.tensor[11].item() == 0xBB

    def test_duplicate_label_refused(self, pool: MemoryPool) -> None:
        pool.allocate("same", (8,), torch.float32)
        with pytest.raises((ValueError, PDError)):
            pool.allocate("same", (8,), torch.float32)

    def test_many_labels_unique(self, pool: MemoryPool) -> None:
        buffers = [pool.allocate(f"layer{i}_{kv}", (16, 4), torch.float16)
                   for i in range(32) for kv in "kv"]
        assert len({b.region.addr for b in buffers}) == len(buffers)

    def test_close_idempotent(self) -> None:
        pool = self.make_pool()
        pool.allocate("a", (16,), torch.float32)
        pool.close()
        pool.close()
