"""shm backend, cma mode: writes into a peer's private (thp pool) memory with
process_vm_writev; identity, pid namespace and permission checks; the mode switch."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from pdcore.builtin import shm_copy
from pdcore.builtin.shm_backend import preferred_pool
from pdcore.builtin.thp_pool import HUGE, ThpMemoryPool
from pdcore.errors import ConfigError, PDError, TransferError
from pdcore.interfaces.memory import PoolContext
from pdcore.interfaces.transfer import TransferStatus
from pdcore.testing.remote import ReceiverSpec, RemoteReceiver, sentinel

from .shm_util import REGION, batch, sending_engine

pytestmark = pytest.mark.skipif(not shm_copy.cma_permitted()[0],
                                reason=f"cma not permitted here: {shm_copy.cma_permitted()[1]}")


@pytest.fixture
def sender():
    with sending_engine(ThpMemoryPool(PoolContext(server_id="cmatest-p")), "cmatest-p", 2,
                        2) as s:
        yield s


@pytest.fixture
def remote():
    with RemoteReceiver(ReceiverSpec("shm", "", "thp", "cpu", REGION, 2, seed=5)) as r:
        yield r


def with_endpoint(remote, **change) -> bytes:
    return json.dumps(json.loads(remote.endpoint) | change).encode()


def test_bytes_land_in_the_peer_and_nothing_is_mapped(sender, remote) -> None:
    eng, base, data = sender
    maps_before = shm_maps()
    peer = eng.connect(remote.endpoint, remote.regions)
    r0, r1 = remote.regions
    items = batch([base, base + 5000, base + REGION], [r0.addr + 7, r1.addr, r1.addr + 4096],
                  [4000, 1, REGION - 4096])
    assert eng.wait(eng.write(peer, items), 10).status is TransferStatus.DONE
    want0, want1 = sentinel(5, 0, REGION), sentinel(5, 1, REGION)
    want0[7:4007] = data[:4000]
    want1[0] = data[5000]
    want1[4096:] = data[REGION:2 * REGION - 4096]
    assert np.array_equal(remote.read(0), want0)
    assert np.array_equal(remote.read(1), want1)
    assert shm_maps() == maps_before  # cma maps nothing of the peer here


def shm_maps() -> set[str]:
    with open("/proc/self/maps") as f:
        return {line.split()[-1] for line in f if "/dev/shm/" in line}


def test_wrong_identity_refused_at_connect(sender, remote) -> None:
    eng, _, _ = sender
    bad = with_endpoint(remote, nonce="00" * 16)
    with pytest.raises(TransferError, match="belongs to another process"):
        eng.connect(bad, remote.regions)
    with pytest.raises(TransferError, match="malformed peer endpoint"):
        eng.connect(with_endpoint(remote, nonce=""), remote.regions)  # nothing to check against
    with pytest.raises(TransferError, match="pid namespace"):
        eng.connect(with_endpoint(remote, pidns="pid:[1]"), remote.regions)


def test_reused_pid_fails_the_write_not_the_stranger(sender, remote) -> None:
    """The peer's pid now names another (live) process: the nonce check fails the copy."""
    eng, base, _ = sender
    peer = eng.connect(remote.endpoint, remote.regions)
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        peer.state.pid = stranger.pid  # what pid reuse would look like from here
        res = eng.wait(eng.write(peer, batch([base], [remote.regions[0].addr], [64])), 10)
        assert res.status is TransferStatus.FAILED
        assert "another process" in res.reason and "nothing copied" in res.reason
        assert stranger.poll() is None  # the stranger was not written into (it would crash)
    finally:
        stranger.kill()
        stranger.wait()


def test_killed_peer_fails_fast(sender, remote) -> None:
    eng, base, _ = sender
    peer = eng.connect(remote.endpoint, remote.regions)
    remote.kill()
    res = eng.wait(eng.write(peer, batch([base], [remote.regions[0].addr], [64])), 10)
    assert res.status is TransferStatus.FAILED and "exited" in res.reason


def test_not_permitted_says_how_to_fix(sender, remote, monkeypatch) -> None:
    eng, _, _ = sender
    monkeypatch.setattr(shm_copy, "cma_permitted", lambda: (False, "ptrace_scope is 1"))
    with pytest.raises(TransferError, match="ptrace_scope is 1.*PDCORE_SHM_MODE=segment"):
        eng.connect(remote.endpoint, remote.regions)


def test_mode_picks_the_pool(monkeypatch) -> None:
    assert preferred_pool({}) == "thp"
    assert preferred_pool({"PDCORE_SHM_MODE": "CMA"}) == "thp"
    assert preferred_pool({"PDCORE_SHM_MODE": "segment"}) == "shm"
    with pytest.raises(ConfigError, match="PDCORE_SHM_MODE must be one of"):
        preferred_pool({"PDCORE_SHM_MODE": "fast"})
    monkeypatch.setattr(shm_copy, "cma_permitted", lambda: (False, "seccomp"))
    assert preferred_pool({}) == "shm"
    with pytest.raises(ConfigError, match="seccomp.*PDCORE_SHM_MODE=segment"):
        preferred_pool({"PDCORE_SHM_MODE": "cma"})


def test_thp_pool_is_aligned_zeroed_and_huge() -> None:
    pool = ThpMemoryPool(PoolContext(server_id="cmatest-thp"))
    try:
        buf = pool.allocate("kv", (4, HUGE // 4), torch.float32)  # 8 MiB
        assert buf.region.addr % HUGE == 0 and buf.region.length == 4 * HUGE
        # nothing resident until written (#45 item 14); reads see zeros
        assert _smaps_kib(buf.region.addr, "Rss:") < 1024
        assert not buf.tensor.any()
        buf.tensor[0].fill_(1.0)  # the first 2 MiB written
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            thp = f.read()
        if "[never]" in thp:
            pytest.skip("THP is disabled on this kernel")
        assert _anon_huge_kib(buf.region.addr) > 0, "no huge page backs the pool"
        with pytest.raises(ValueError, match="already allocated"):
            pool.allocate("kv", (8,), torch.uint8)
    finally:
        pool.close()
    with pytest.raises(PDError, match="closed"):
        pool.allocate("late", (8,), torch.uint8)


def _anon_huge_kib(addr: int) -> int:
    """AnonHugePages of the mapping containing `addr` (/proc/self/smaps)."""
    return _smaps_kib(addr, "AnonHugePages:")


def _smaps_kib(addr: int, field: str) -> int:
    """A field (kB) of the mapping containing `addr` in /proc/self/smaps."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == field:
                return int(line.split()[1])
    return 0
