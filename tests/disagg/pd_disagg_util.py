"""Test helpers: small KV pools in host memory, manager factories, and a child-process manager.

The child (`serve_manager`, run with multiprocessing spawn) hosts one Prefill or Decode KV
manager and answers commands over a Pipe, so tests can kill it like a crashed server.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from pdcore.config import DisaggEnv, ServerArgs
from pdcore.disagg.aux import AuxBuffers, AuxRow
from pdcore.disagg.decode import DecodeKVManager
from pdcore.disagg.prefill import PrefillKVManager
from pdcore.interfaces.memory import Buffer, MemoryPool
from pdcore.interfaces.planner import KVLayout
from pdcore.interfaces.transfer import MemoryRegion
from pdcore.testing.processes import free_port  # noqa: F401 - the tests import it from here

LAYERS, PAGES, PAGE_SIZE, HEADS, DIM = 4, 32, 4, 2, 8
FAST_ENV = {
    "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "20",
    "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "20",
    "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "0.3",
    "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "2",
    "SGLANG_DISAGGREGATION_THREAD_POOL_SIZE": "2",
    "SGLANG_DISAGGREGATION_QUEUE_SIZE": "2",
    "SGLANG_DISAGGREGATION_BOOTSTRAP_ENTRY_CLEANUP_INTERVAL": "30",
    "PDCORE_TCP_TIMEOUT": "5",
}


def wait_for(pred: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.01)


class HostPool(MemoryPool):
    """Plain zeroed torch tensors in host memory."""

    name = "testhost"

    def __init__(self) -> None:
        self.bufs: dict[str, torch.Tensor] = {}

    def allocate(self, label: str, shape: Sequence[int], dtype: torch.dtype) -> Buffer:
        t = torch.zeros(tuple(shape), dtype=dtype)
        self.bufs[label] = t
        return Buffer(t, MemoryRegion(t.data_ptr(), t.numel() * t.element_size(), name=label))

    def close(self) -> None:
        self.bufs.clear()


class TestKV:
    __test__ = False  # not a pytest class

    def __init__(self, seed: int | None = None, tp_rank: int = 0, tp_size: int = 1,
                 total_heads: int = HEADS, pages: int = PAGES, aux_slots: int = 8,
                 pool: MemoryPool | None = None) -> None:
        heads = max(1, total_heads // tp_size)
        self.pool = pool or HostPool()
        shape = (pages, PAGE_SIZE, heads, DIM)
        self.k = [self.pool.allocate(f"k{i}", shape, torch.float32) for i in range(LAYERS)]
        self.v = [self.pool.allocate(f"v{i}", shape, torch.float32) for i in range(LAYERS)]
        if seed is not None:
            g = torch.Generator().manual_seed(seed * 1000 + tp_rank)
            for b in self.k + self.v:
                b.tensor.copy_(torch.randn(shape, generator=g))
        self.aux = AuxBuffers(self.pool, aux_slots)
        self.regions = [b.region for b in self.k + self.v]
        self.layout = KVLayout(
            num_layers=LAYERS, page_size=PAGE_SIZE, kv_heads=heads, head_dim=DIM, elem_size=4,
            k_bases=tuple(b.region.addr for b in self.k),
            v_bases=tuple(b.region.addr for b in self.v), num_pages=pages, tp_rank=tp_rank,
            tp_size=tp_size, total_kv_heads=total_heads, dtype="float32")

    def dump(self, pages: Sequence[int]) -> np.ndarray:
        """[2 * layers, len(pages), page_size, heads, dim] copy of the given pages."""
        idx = torch.as_tensor(list(pages), dtype=torch.long)
        return torch.stack([b.tensor[idx] for b in self.k + self.v]).numpy().copy()

    def all_zero_except(self, pages: Sequence[int]) -> bool:
        mask = torch.ones(self.layout.num_pages, dtype=torch.bool)
        mask[list(pages)] = False
        return all(not b.tensor[mask].any() for b in self.k + self.v)


def make_env(**extra: str) -> DisaggEnv:
    return DisaggEnv.from_env({**FAST_ENV, **extra})


def make_args(role: str, bootstrap_port: int, token: str | None = None,
              server_id: str | None = None) -> ServerArgs:
    extra = {"server_id": server_id} if server_id else {}
    return ServerArgs(host="127.0.0.1", disaggregation_mode=role,
                      disaggregation_bootstrap_port=bootstrap_port,
                      disaggregation_auth_token=token, **extra)


def prefill(kv: TestKV, port: int, env: DisaggEnv, backend: str = "tcp",
            token: str | None = None, tp_rank: int = 0, tp_size: int = 1) -> PrefillKVManager:
    # the ranks of one P instance share its route secret (the engine broadcasts rank 0's)
    m = PrefillKVManager(make_args("prefill", port, token), env, kv.layout, kv.regions, kv.aux,
                         backend, tp_rank=tp_rank, tp_size=tp_size, route_secret=f"test-{port}")
    m.start()
    return m


def decode(kv: TestKV, env: DisaggEnv, backend: str = "tcp", token: str | None = None,
           tp_rank: int = 0, tp_size: int = 1, server_id: str = "test-decode") -> DecodeKVManager:
    # the ranks of one D server share its server id (P binds a room to one decode server)
    m = DecodeKVManager(make_args("decode", 1, token, server_id), env, kv.layout, kv.regions, kv.aux,
                        backend, tp_rank=tp_rank, tp_size=tp_size)
    m.start()
    return m


# -- child process -----------------------------------------------------------------------------
def serve_manager(conn: Any, role: str, port: int, env: dict[str, str], seed: int | None) -> None:
    logging.basicConfig(level=logging.WARNING, format=f"[{role}] %(levelname)s %(message)s")
    kv = TestKV(seed=seed)
    denv = make_env(**env)
    mgr = prefill(kv, port, denv) if role == "prefill" else decode(kv, denv)

    def write_aux(slot: int, room: int, token: int) -> None:
        kv.aux.write(slot, AuxRow(room=room, first_token_id=token, logprob=-0.5,
                                  top_ids=(token, 7), top_logprobs=(-0.5, -2.0),
                                  cached_tokens=3, prompt_tokens=11))

    cmds: dict[str, Callable[..., Any]] = {
        "add": mgr.add, "poll": lambda room: int(mgr.poll(room)),
        "reason": mgr.failure_reason, "metrics": mgr.metrics, "abort": mgr.abort,
        "release": mgr.release, "dump": kv.dump, "write_aux": write_aux,
        "read_aux": lambda slot: kv.aux.read(slot), "zero_except": kv.all_zero_except,
    }
    if role == "prefill":
        cmds.update(send=lambda room, pages, start, last, aux: mgr.send(
            room, np.asarray(pages), start, last, aux), dest_pages=mgr.dest_page_count)
    else:
        cmds.update(send_transfer_info=lambda room, pages, slot: mgr.send_transfer_info(
            room, np.asarray(pages), slot))
    conn.send(("ready", None))
    while True:
        try:
            cmd, args = conn.recv()
        except EOFError:
            break
        if cmd == "exit":
            break
        try:
            conn.send(("ok", cmds[cmd](*args)))
        except Exception as e:  # noqa: BLE001 - reported to the test, which fails with it
            conn.send(("err", f"{type(e).__name__}: {e}"))
    mgr.close()


class Remote:
    """Parent-side handle on a serve_manager child."""

    def __init__(self, role: str, port: int, env: dict[str, str] | None = None,
                 seed: int | None = None) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=serve_manager, args=(child, role, port, env or {}, seed),
                                daemon=True)
        self.proc.start()
        child.close()
        if not self.conn.poll(60):
            self.kill()
            raise AssertionError(f"{role} child did not start within 60s")
        tag, _ = self.conn.recv()
        assert tag == "ready"

    def __call__(self, cmd: str, *args: Any, timeout: float = 20.0) -> Any:
        self.conn.send((cmd, args))
        if not self.conn.poll(timeout):
            raise AssertionError(f"child did not answer {cmd} within {timeout}s")
        tag, value = self.conn.recv()
        if tag == "err":
            raise AssertionError(f"child {cmd} failed: {value}")
        return value

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(("exit", ()))
            except OSError:
                pass
            self.proc.join(10)
        self.kill()
