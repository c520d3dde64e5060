"""The backend contract suite, run against a small reference backend (in one process and
across processes) and against a corrupting one, which it must reject."""

from __future__ import annotations

import pytest
from plugins_refbackend import CorruptingEngine, RefEngine, SilentEngine

from pdcore.testing.backend_contract import BackendContract, CrossProcessBackendContract

REF = f"{RefEngine.__module__}:RefEngine"


class TestRefBackend(BackendContract):
    engine_factory = REF
    many_items = 600
    dead_peer_timeout = 10.0


class TestRefBackendCrossProcess(CrossProcessBackendContract):
    engine_factory = REF
    many_items = 600
    dead_peer_timeout = 10.0


class _Corrupting(BackendContract):
    engine_factory = f"{CorruptingEngine.__module__}:CorruptingEngine"
    many_items = 50


def test_backend_contract_catches_corruption() -> None:
    suite = _Corrupting()
    with suite.open_pair() as pair, pytest.raises(AssertionError, match="byte.* differ"):
        suite.test_scattered_batch(pair)


class _Silent(BackendContract):
    engine_factory = f"{SilentEngine.__module__}:SilentEngine"
    dead_peer_timeout = 0.5


def test_backend_contract_bounds_a_write_that_never_finishes() -> None:
    suite = _Silent()
    with suite.open_pair() as pair, pytest.raises(AssertionError, match="did not fail within"):
        suite.test_write_to_closed_peer_fails(pair)
