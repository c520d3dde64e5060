"""Test helpers: KV pools of one TP rank in host memory and real P/D KV managers over tcp."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from pd_staging.geometry import head_span

from pdcore.config import DisaggEnv, ServerArgs
from pdcore.disagg.aux import AuxBuffers
from pdcore.disagg.decode import DecodeKVManager
from pdcore.disagg.prefill import PrefillKVManager
from pdcore.interfaces.memory import Buffer, MemoryPool
from pdcore.interfaces.planner import KVLayout
from pdcore.interfaces.transfer import MemoryRegion
from pdcore.testing.processes import free_port  # noqa: F401 - the tests import it from here

LAYERS, PAGES, PAGE_SIZE, DIM = 3, 64, 4, 8
FAST_ENV = {
    "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "20",
    "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "20",
    "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "0.5",
    "SGLANG_DISAGGREGATION_THREAD_POOL_SIZE": "2",
    "SGLANG_DISAGGREGATION_QUEUE_SIZE": "2",
    "PDCORE_TCP_TIMEOUT": "5",
    "SGLANG_DISAGG_STAGING_BUFFER": "1",
    "SGLANG_DISAGG_STAGING_BUFFER_SIZE_MB": "1",
    "SGLANG_DISAGG_STAGING_POOL_SIZE_MB": "1",
}


def wait_for(pred: Callable[[], Any], timeout: float = 15.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.01)


class HostPool(MemoryPool):
    name = "testhost"

    def __init__(self) -> None:
        self.bufs: dict[str, torch.Tensor] = {}

    def allocate(self, label: str, shape: Sequence[int], dtype: torch.dtype) -> Buffer:
        t = torch.zeros(tuple(shape), dtype=dtype)
        self.bufs[label] = t
        return Buffer(t, MemoryRegion(t.data_ptr(), t.numel() * t.element_size(), name=label))

    def close(self) -> None:
        self.bufs.clear()


class RankKV:
    """One TP rank's KV pool (floor head split, like the engine) plus its aux rows."""

    def __init__(self, tp_rank: int, tp_size: int, total_heads: int, seed: int | None = None,
                 pages: int = PAGES) -> None:
        self.pool = HostPool()
        self.first, heads = head_span(total_heads, tp_rank, tp_size)
        shape = (pages, PAGE_SIZE, heads, DIM)
        self.k = [self.pool.allocate(f"k{i}", shape, torch.float32) for i in range(LAYERS)]
        self.v = [self.pool.allocate(f"v{i}", shape, torch.float32) for i in range(LAYERS)]
        if seed is not None:  # the model's "true" KV: the same head has the same values on
            g = torch.Generator().manual_seed(seed)  # every rank holding it
            full = torch.randn((2 * LAYERS, pages, PAGE_SIZE, total_heads, DIM), generator=g)
            for b, src in zip(self.k + self.v, full):
                b.tensor.copy_(src[:, :, self.first:self.first + heads])
        self.aux = AuxBuffers(self.pool, 8)
        self.layers = [(k.tensor, v.tensor) for k, v in zip(self.k, self.v)]
        self.regions = [b.region for b in self.k + self.v]
        self.layout = KVLayout(
            num_layers=LAYERS, page_size=PAGE_SIZE, kv_heads=heads, head_dim=DIM, elem_size=4,
            k_bases=tuple(b.region.addr for b in self.k),
            v_bases=tuple(b.region.addr for b in self.v), num_pages=pages, tp_rank=tp_rank,
            tp_size=tp_size, total_kv_heads=total_heads, dtype="float32")

    def dump(self, pages: Sequence[int]) -> np.ndarray:
        idx = torch.as_tensor(list(pages), dtype=torch.long)
        return torch.stack([b.tensor[idx] for b in self.k + self.v]).numpy().copy()


def truth(total_heads: int, seed: int, pages: Sequence[int], first: int, n: int) -> np.ndarray:
    g = torch.Generator().manual_seed(seed)
    full = torch.randn((2 * LAYERS, PAGES, PAGE_SIZE, total_heads, DIM), generator=g)
    idx = torch.as_tensor(list(pages), dtype=torch.long)
    return full[:, idx][..., first:first + n, :].numpy()


def env(**extra: str) -> DisaggEnv:
    return DisaggEnv.from_env({**FAST_ENV, **extra})


def args(role: str, port: int) -> ServerArgs:
    # the ranks of one server share its server id (P binds a room to one decode server)
    return ServerArgs(host="127.0.0.1", disaggregation_mode=role,
                      disaggregation_bootstrap_port=port, server_id=f"test-{role}")


def prefill(kv: RankKV, port: int, e: DisaggEnv) -> PrefillKVManager:
    lay = kv.layout
    # the ranks of one P instance share its route secret (the engine broadcasts rank 0's)
    m = PrefillKVManager(args("prefill", port), e, lay, kv.regions, kv.aux, "tcp",
                         tp_rank=lay.tp_rank, tp_size=lay.tp_size, kv_tensors=kv.layers,
                         pool=kv.pool, route_secret=f"test-{port}")
    m.start()
    return m


def decode(kv: RankKV, e: DisaggEnv) -> DecodeKVManager:
    lay = kv.layout
    m = DecodeKVManager(args("decode", 1), e, lay, kv.regions, kv.aux, "tcp", tp_rank=lay.tp_rank,
                        tp_size=lay.tp_size, kv_tensors=kv.layers, pool=kv.pool)
    m.start()
    return m
