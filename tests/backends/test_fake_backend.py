"""fake backend: reports success at once and moves nothing."""

from __future__ import annotations

import numpy as np
import pytest

from pdcore.builtin.fake_backend import FakeTransferEngine
from pdcore.errors import TransferError
from pdcore.interfaces.transfer import BackendContext, CopyBatch, MemoryRegion, TransferStatus


def test_moves_nothing_and_reports_done() -> None:
    eng = FakeTransferEngine(BackendContext())
    assert eng.capabilities.moves_data is False
    src, dst = np.ones(4096, dtype=np.uint8), np.zeros(4096, dtype=np.uint8)
    eng.register([MemoryRegion(src.ctypes.data, 4096)])
    peer = eng.connect(b"anything at all", [])
    u = np.uint64
    b = CopyBatch(np.array([src.ctypes.data], u), np.array([dst.ctypes.data], u),
                  np.array([4096], u))
    h = eng.write(peer, b)
    assert eng.poll(h).status is TransferStatus.DONE  # at once, no waiting
    assert not dst.any()
    assert eng.poll(h).status is TransferStatus.FAILED  # released by the first poll
    assert (eng.batches, eng.bytes_reported) == (1, 4096)
    eng.close()
    eng.close()
    with pytest.raises(TransferError, match="closed"):
        eng.write(peer, b)
