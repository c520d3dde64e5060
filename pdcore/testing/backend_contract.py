"""Contract suite for transfer backends: subclass, name the backend, run pytest.

    from pdcore.testing.backend_contract import BackendContract, CrossProcessBackendContract

    class TestMyBackend(BackendContract):
        backend_name = "mybackend"          # a registered name; or override make_engine()

    class TestMyBackendAcrossProcesses(CrossProcessBackendContract):
        backend_name = "mybackend"

Each test builds a receiver (its own engine and destination buffers from the memory pool named
`pool_name`, registered) and a sender (engine, source buffers, registered), connects the sender
to the receiver's endpoint and regions, as the core's control plane does, and checks:
1. capabilities are declared and cover the pool's memory kind; endpoint() is stable bytes;
2. scattered batches (odd sizes, many items, more items than capabilities.max_batch, one large
   copy, a zero-length batch) end DONE within `timeout` and leave exactly the expected bytes at
   the destination, and nothing else changed;
3. several writes in flight at once all complete;
4. a write to a closed peer ends FAILED (or raises TransferError) within `dead_peer_timeout`;
5. close() is idempotent;
6. poll() and wait() of an unknown handle (never issued, or already reported DONE/FAILED) answer
   FAILED with a reason naming the handle: no exception, never PENDING.
Backends declaring capabilities.moves_data = False (`fake`) skip the byte and dead-peer checks.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from pdcore.errors import PDError
from pdcore.interfaces.memory import Buffer, MemoryPool
from pdcore.interfaces.transfer import (
    Capabilities,
    CopyBatch,
    MemoryRegion,
    Peer,
    PollResult,
    TransferEngine,
    TransferStatus,
)
from pdcore.testing.copies import DEFAULT_SIZES, CopyPlan, first_difference, random_plan, wait_all
from pdcore.testing.remote import (
    BackendSettings,
    RemoteReceiver,
    buffer_bytes,
    fill_buffer,
    sentinel,
)

__all__ = ["BackendContract", "BackendSettings", "CrossProcessBackendContract", "Pair"]


@dataclass
class Side:
    engine: TransferEngine
    pool: MemoryPool
    buffers: list[Buffer]

    @property
    def regions(self) -> list[MemoryRegion]:
        return [b.region for b in self.buffers]


@dataclass
class Pair:
    """A connected sender -> receiver, the source bytes and what the destination must hold."""

    sender: Side
    receiver: Side
    peer: Peer
    src: list[np.ndarray]
    expected: list[np.ndarray]
    capabilities: Capabilities
    handles: list[int] = field(default_factory=list)

    def submit(self, plan: CopyPlan) -> int:
        handle = self.sender.engine.write(self.peer, plan.batch(self.sender.regions,
                                                                self.receiver.regions))
        plan.apply(self.src, self.expected)
        return handle

    def verify(self) -> None:
        if not self.capabilities.moves_data:
            return
        for i, buf in enumerate(self.receiver.buffers):
            actual = buffer_bytes(buf)
            assert np.array_equal(actual, self.expected[i]), (
                f"destination buffer {i}: {first_difference(actual, self.expected[i])}"
            )


def _assert_done(results: list[PollResult]) -> None:
    bad = [(i, r.reason) for i, r in enumerate(results) if r.status is not TransferStatus.DONE]
    assert not bad, f"writes not DONE (index, reason): {bad[:5]}"


class BackendContract(BackendSettings):
    """In-process suite: sender and receiver engines live in the test process."""

    @contextmanager
    def open_pair(self, seed: int = 0) -> Iterator[Pair]:
        rng = np.random.default_rng(seed)
        with ExitStack() as stack:
            sides = []
            for role in ("decode", "prefill"):  # receiver first, as in a real deployment
                pool = self.make_pool(role)
                stack.callback(pool.close)
                engine = self.make_engine(role)
                stack.callback(engine.close)
                buffers = [pool.allocate(f"{role}-{i}", (self.region_bytes,), torch.uint8)
                           for i in range(self.regions_per_side)]
                sides.append(Side(engine, pool, buffers))
            receiver, sender = sides
            src = [rng.integers(0, 256, self.region_bytes, dtype=np.uint8)
                   for _ in sender.buffers]
            dst = [sentinel(seed, i, self.region_bytes) for i in range(len(receiver.buffers))]
            for buf, data in zip(sender.buffers + receiver.buffers, src + dst, strict=True):
                fill_buffer(buf, data)
            receiver.engine.register(receiver.regions)
            sender.engine.register(sender.regions)
            peer = sender.engine.connect(receiver.engine.endpoint(), receiver.regions)
            yield Pair(sender, receiver, peer, src, [d.copy() for d in dst],
                       sender.engine.capabilities)

    @pytest.fixture
    def contract_pair(self) -> Iterator[Pair]:
        with self.open_pair() as pair:
            yield pair

    def plan(self, pair: Pair, n_items: int, seed: int = 1, sizes: Sequence[int] = DEFAULT_SIZES,
             fill: float = 0.6) -> CopyPlan:
        caps = [self.region_bytes] * self.regions_per_side
        return random_plan(np.random.default_rng(seed), n_items, caps, caps, sizes, fill)

    def run_plans(self, pair: Pair, plans: list[CopyPlan]) -> None:
        handles = [pair.submit(p) for p in plans]
        _assert_done(wait_all(pair.sender.engine, handles, self.timeout))
        pair.verify()

    # -- 1. declarations --------------------------------------------------------------------

    def test_capabilities(self, contract_pair: Pair) -> None:
        caps = contract_pair.capabilities
        assert isinstance(caps, Capabilities)
        assert caps.max_batch >= 1
        assert caps.memory_kinds, "capabilities.memory_kinds is empty"
        kind = contract_pair.receiver.regions[0].kind
        assert kind in caps.memory_kinds, (
            f"pool {self.pool_name!r} gives {kind} regions, which the backend does not declare; "
            f"set pool_name to a pool this backend supports"
        )

    def test_endpoint_is_stable_bytes(self, contract_pair: Pair) -> None:
        ep = contract_pair.receiver.engine.endpoint()
        assert isinstance(ep, bytes) and ep, f"endpoint() must return non-empty bytes, got {ep!r}"
        assert contract_pair.receiver.engine.endpoint() == ep
        assert isinstance(contract_pair.peer, Peer)

    # -- 2. bytes ---------------------------------------------------------------------------

    def test_single_copy(self, contract_pair: Pair) -> None:
        self.run_plans(contract_pair, [self.plan(contract_pair, 1, sizes=(4096,))])

    def test_scattered_batch(self, contract_pair: Pair) -> None:
        self.run_plans(contract_pair, [self.plan(contract_pair, self.many_items)])

    def test_large_copy(self, contract_pair: Pair) -> None:
        big = self.region_bytes // 2 + 17
        self.run_plans(contract_pair, [self.plan(contract_pair, 1, sizes=(big,), fill=1.0)])

    def test_more_copies_than_max_batch(self, contract_pair: Pair) -> None:
        """The core splits batches at max_batch and keeps the pieces in flight together."""
        max_batch = contract_pair.capabilities.max_batch
        n = 2 * max_batch + 1 if max_batch <= self.many_items else self.many_items
        plan = self.plan(contract_pair, n, sizes=(8, 64, 100))
        parts = max(1, -(-n // max_batch))
        self.run_plans(contract_pair, plan.split(parts))

    def test_oversized_batch_fails_cleanly(self, contract_pair: Pair) -> None:
        """A batch above max_batch is either carried out or refused clearly, never hangs."""
        max_batch = contract_pair.capabilities.max_batch
        if max_batch > self.many_items:
            pytest.skip(f"max_batch {max_batch} is too large to exceed in a test")
        plan = self.plan(contract_pair, max_batch + 1, sizes=(8, 64))
        try:
            handle = contract_pair.submit(plan)
        except (ValueError, PDError):
            return
        (result,) = wait_all(contract_pair.sender.engine, [handle], self.timeout)
        assert result.status is not TransferStatus.PENDING
        if result.status is TransferStatus.DONE:
            contract_pair.verify()
        else:
            assert result.reason, "FAILED must carry a reason"

    def test_zero_length_batch(self, contract_pair: Pair) -> None:
        handle = contract_pair.sender.engine.write(contract_pair.peer, CopyBatch.empty())
        _assert_done(wait_all(contract_pair.sender.engine, [handle], self.timeout))
        contract_pair.verify()

    # -- 3. concurrency ---------------------------------------------------------------------

    def test_writes_in_flight(self, contract_pair: Pair) -> None:
        plan = self.plan(contract_pair, min(self.many_items, 800))
        self.run_plans(contract_pair, plan.split(8))

    # -- 4. failures ------------------------------------------------------------------------

    def test_write_to_closed_peer_fails(self, contract_pair: Pair) -> None:
        if not contract_pair.capabilities.moves_data:
            pytest.skip("backend moves no data; it has no peer to lose")
        self.run_plans(contract_pair, [self.plan(contract_pair, 4, seed=2)])  # connection is up
        contract_pair.receiver.engine.close()
        assert_fails_within(self, contract_pair.sender.engine, contract_pair.peer,
                            self.plan(contract_pair, 4, seed=3).batch(
                                contract_pair.sender.regions, contract_pair.receiver.regions))

    # -- 5. lifecycle -----------------------------------------------------------------------

    def test_close_idempotent(self, contract_pair: Pair) -> None:
        for side in (contract_pair.sender, contract_pair.receiver):
            side.engine.close()
            side.engine.close()

    # -- 6. unknown handles -----------------------------------------------------------------

    def test_unknown_handle_is_failed(self, contract_pair: Pair) -> None:
        engine = contract_pair.sender.engine
        never_issued = (1 << 62) + 12345
        reported = contract_pair.submit(self.plan(contract_pair, 2, seed=4))
        _assert_done(wait_all(engine, [reported], self.timeout))
        for handle in (never_issued, reported):  # DONE released `reported`
            for answer in (engine.poll(handle), engine.wait(handle, self.timeout)):
                assert answer.status is TransferStatus.FAILED, (
                    f"poll/wait of unknown handle {handle} answered {answer.status.value}; the "
                    f"transfer contract says FAILED")
                assert str(handle) in (answer.reason or ""), (
                    f"the reason must name the unknown handle {handle}: {answer.reason!r}")


def assert_fails_within(settings: BackendSettings, engine: TransferEngine, peer: Peer,
                        batch: CopyBatch) -> None:
    """A write to a dead peer must raise or end FAILED (not stay PENDING) in time."""
    try:
        handle = engine.write(peer, batch)
    except PDError:
        return  # refused at once (TransferError): the clearest failure
    (result,) = wait_all(engine, [handle], settings.dead_peer_timeout)
    assert result.status is not TransferStatus.PENDING
    if settings.detects_dead_peer:
        assert result.status is TransferStatus.FAILED, (
            f"write to a dead peer ended {result.status.value}; it must fail (or set "
            f"detects_dead_peer = False with a reason)")
        assert result.reason and "still pending" not in result.reason, (
            f"write to a dead peer did not fail within {settings.dead_peer_timeout}s: "
            f"{result.reason}")


class CrossProcessBackendContract(BackendSettings):
    """The receiver engine runs in a child process (multiprocessing spawn), as in production."""

    def _sender(self, stack: ExitStack, seed: int) -> tuple[Side, list[np.ndarray]]:
        pool = self.make_pool("prefill")
        stack.callback(pool.close)
        engine = self.make_engine("prefill")
        stack.callback(engine.close)
        buffers = [pool.allocate(f"src-{i}", (self.region_bytes,), torch.uint8)
                   for i in range(self.regions_per_side)]
        rng = np.random.default_rng(seed)
        src = [rng.integers(0, 256, self.region_bytes, dtype=np.uint8) for _ in buffers]
        for buf, data in zip(buffers, src, strict=True):
            fill_buffer(buf, data)
        engine.register([b.region for b in buffers])
        return Side(engine, pool, buffers), src

    def _plan(self, n: int, seed: int) -> CopyPlan:
        sizes = [self.region_bytes] * self.regions_per_side
        return random_plan(np.random.default_rng(seed), n, sizes, sizes)

    def _write_and_verify(self, sender: Side, src: list[np.ndarray], remote: RemoteReceiver,
                          plans: list[CopyPlan]) -> Peer:
        peer = sender.engine.connect(remote.endpoint, remote.regions)
        expected = [sentinel(remote.seed, i, self.region_bytes)
                    for i in range(self.regions_per_side)]
        handles = []
        for plan in plans:
            handles.append(sender.engine.write(peer, plan.batch(sender.regions, remote.regions)))
            plan.apply(src, expected)
        _assert_done(wait_all(sender.engine, handles, self.timeout))
        if sender.engine.capabilities.moves_data:
            for i in range(self.regions_per_side):
                actual = remote.read(i)
                assert np.array_equal(actual, expected[i]), (
                    f"remote buffer {i}: {first_difference(actual, expected[i])}")
        return peer

    def test_cross_process_writes(self) -> None:
        with ExitStack() as stack:
            sender, src = self._sender(stack, seed=5)
            remote = stack.enter_context(RemoteReceiver(self.receiver_spec(seed=11)))
            self._write_and_verify(sender, src, remote, self._plan(self.many_items, 6).split(4))

    def test_killed_peer_fails_then_new_peer_works(self) -> None:
        with ExitStack() as stack:
            sender, src = self._sender(stack, seed=7)
            remote = stack.enter_context(RemoteReceiver(self.receiver_spec(seed=12)))
            peer = self._write_and_verify(sender, src, remote, [self._plan(16, 8)])
            if not sender.engine.capabilities.moves_data:
                pytest.skip("backend moves no data; it has no peer to lose")
            remote.kill()
            assert_fails_within(self, sender.engine, peer,
                                self._plan(16, 9).batch(sender.regions, remote.regions))
            sender.engine.disconnect(peer)
            # a restarted peer (new process, new endpoint) is reachable from the same engine
            fresh = stack.enter_context(RemoteReceiver(self.receiver_spec(seed=13)))
            self._write_and_verify(sender, src, fresh, [self._plan(64, 10)])
