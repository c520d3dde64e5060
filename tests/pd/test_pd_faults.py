"""Kill P, kill D, client disconnect — for the built-in backends (tiny model, real processes).

`shm` runs in its default mode (cma into the thp pool where the kernel permits it); `shm-segment`
forces the shared-memory segments (PDCORE_SHM_MODE=segment) for the kill tests, whose clean-up
check (no segment of a dead process left) matters most there. One cluster per mode serves its
tests one after another (a killed server is restarted on its ports by the test itself). The kill
tests do not run again over default-mode shm: the fault matrix (test_fault_matrix.py, its own CI
entry) kills P's and D's HTTP process and scheduler over shm with the same checks (no hang,
every page free, the restarted server serves), and the client disconnect does not depend on the
data mover beyond tcp and shm."""

from __future__ import annotations

import httpx
import pytest

from pdcore.testing import pd_faults
from pdcore.testing.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from pdcore.engine.model.tokenizer import default_model_file

    return make_tiny_model(str(tmp_path_factory.mktemp("pdfault") / "m"), hidden=64, layers=2,
                           tokenizer_from=default_model_file(), max_positions=8192)


MODES = {"tcp": ("tcp", {}), "shm": ("shm", {}),
         "shm-segment": ("shm", {"PDCORE_SHM_MODE": "segment"})}
KILL_MODES = ["tcp", "shm-segment"]
DISCONNECT_MODES = ["tcp", "shm"]


@pytest.fixture(scope="module")
def cluster(request, model_dir):
    """One cluster per mode (indirect parameter), shared by that mode's tests."""
    from pdcore.builtin.shm_backend import preferred_pool

    backend, env = MODES[request.param]
    c = pd_faults.fault_cluster(backend, model_dir, env)
    try:
        if backend == "shm":  # the mode under test is the one the servers really run
            for s in (*c.prefills, *c.decodes):
                info = httpx.get(s.url + "/server_info", timeout=10).json()
                assert info["memory_pool"] == preferred_pool(env), info["memory_pool"]
        yield c
    finally:
        c.stop()


@pytest.mark.parametrize("cluster", KILL_MODES, indirect=True)
def test_kill_prefill_in_flight(cluster):
    pd_faults.kill_prefill_in_flight(cluster)


@pytest.mark.parametrize("cluster", KILL_MODES, indirect=True)
def test_kill_decode_mid_transfer(cluster):
    pd_faults.kill_decode_mid_transfer(cluster)


@pytest.mark.parametrize("cluster", DISCONNECT_MODES, indirect=True)
def test_client_disconnect_mid_stream_frees_both_sides(cluster):
    pd_faults.client_disconnect_mid_stream(cluster)
