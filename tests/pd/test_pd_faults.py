"""Kill P, kill D, client disconnect — for the built-in backends (tiny model, real processes)."""

from __future__ import annotations

import pytest

from pdcore.testing import pd_faults
from pdcore.testing.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from pdcore.engine.tokenizer import default_model_file

    return make_tiny_model(str(tmp_path_factory.mktemp("pdfault") / "m"), hidden=64, layers=2,
                           tokenizer_from=default_model_file(), max_positions=8192)


@pytest.fixture(params=["tcp", "shm"])
def cluster(request, model_dir):
    c = pd_faults.fault_cluster(request.param, model_dir)
    yield c
    c.stop()


def test_kill_prefill_in_flight(cluster):
    pd_faults.kill_prefill_in_flight(cluster)


def test_kill_decode_mid_transfer(cluster):
    pd_faults.kill_decode_mid_transfer(cluster)


def test_client_disconnect_mid_stream_frees_both_sides(cluster):
    pd_faults.client_disconnect_mid_stream(cluster)
