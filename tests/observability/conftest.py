"""Fixtures of the observability tests (owner: helper E; the metric-name tests use them too).

- `obs_cluster` (package scope, so every module in this folder shares one): a real 1P1D cluster
  on loopback, tcp transfer backend, a tiny random Llama (with the default model's tokenizer),
  our router with `--health-check-interval-secs 1`. It is a `pdcore.testing.processes.PDCluster`:
  `.url` is the router, `.prefills[0]` / `.decodes[0]` the servers (`.url`, `.kill()`),
  `.bootstrap_ports[0]` prefill's bootstrap port. A test that kills a worker must bring it back
  with `restart_worker` before it returns, so the modules after it find the cluster whole.

Helpers (obs_helpers.py, `from .obs_helpers import ...`):
- `send_load(cluster, n)`: n short /generate requests through the router, half of them streamed,
  all sharing a prompt prefix (so the prefix cache hits); each must answer 200.
- `restart_worker(cluster, server)`: start a killed server again on its port and wait until the
  router counts it healthy.

This folder is a package (`__init__.py`) because pytest gives package scope only to packages.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pdcore.testing.processes import PDCluster

OBS_TIMEOUT_S = 15  # the cluster's PD bootstrap / waiting timeouts


@pytest.fixture(scope="package")
def obs_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from pdcore.engine.model.tokenizer import default_model_file
    from pdcore.testing.tiny_models import make_tiny_model

    # SmolLM2-135M's KV layout (30 layers x 3 KV heads x 64, bench/transfer_harness.MODEL):
    # test_metric_names compares the servers' transfer bytes with bench/transfer.py's
    return make_tiny_model(str(tmp_path_factory.mktemp("obs") / "m"), hidden=192, layers=30,
                           heads=3, kv_heads=3, tokenizer_from=default_model_file(),
                           max_positions=8192)


@pytest.fixture(scope="package")
def obs_cluster(obs_model_dir: str) -> Iterator[PDCluster]:
    p = "SGLANG_DISAGGREGATION_"  # short timeouts: test_metric_names waits for them to fire
    env = {p + "BOOTSTRAP_TIMEOUT": str(OBS_TIMEOUT_S), p + "WAITING_TIMEOUT": str(OBS_TIMEOUT_S),
           p + "HEARTBEAT_INTERVAL": "1"}
    cluster = PDCluster("tcp", model_path=obs_model_dir, env=env,
                        flags=("--max-total-tokens", "4096", "--page-size", "16")).start()
    try:
        yield cluster
    finally:
        cluster.stop()
