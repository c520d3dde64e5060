"""Kill P / kill D with TP=2 on both sides (tcp): requests fail cleanly within their timeouts,
every KV page comes back on every rank's pool, restarted servers (all their ranks) are picked
up without restarting the other side. The scenarios are pdcore.testing.pd_faults'."""

from __future__ import annotations

import pytest

from pdcore.testing import pd_faults
from pdcore.testing.processes import PDCluster


@pytest.fixture(scope="module")
def cluster(tiny_tp_model):
    c = PDCluster("tcp", model_path=str(tiny_tp_model), flags=pd_faults.FLAGS,
                  env=pd_faults.FAULT_ENV, prefill_flags=("--tp-size", "2"),
                  decode_flags=("--tp-size", "2")).start()
    yield c
    c.stop()


def test_kill_prefill_in_flight_tp2(cluster):
    pd_faults.kill_prefill_in_flight(cluster)


def test_kill_decode_mid_transfer_tp2(cluster):
    pd_faults.kill_decode_mid_transfer(cluster)
