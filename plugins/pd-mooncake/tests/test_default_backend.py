"""With pd-mooncake installed, a P + D pair started WITHOUT --disaggregation-transfer-backend
uses mooncake (SGLang's default) and serves; the servers log which backend and why. Mooncake's
own defaults are left as a new user has them (no MOONCAKE_PROTOCOL): on a machine without an
RDMA NIC it carries the KV over TCP."""

from __future__ import annotations

import httpx
import pytest

from pdcore.testing.processes import PDCluster

pytest.importorskip("mooncake.engine", reason="mooncake-transfer-engine(-non-cuda) not installed")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from pdcore.engine.model.tokenizer import default_model_file
    from pdcore.testing.tiny_models import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("default") / "m"),
                           tokenizer_from=default_model_file())


def test_pd_pair_without_a_backend_flag_uses_mooncake(tiny_model: str) -> None:
    c = PDCluster(None, model_path=tiny_model, env={"MC_LOG_LEVEL": "WARNING"}).start()
    try:
        body = {"text": "The capital of France is",
                "sampling_params": {"max_new_tokens": 8, "temperature": 0.0}}
        r = httpx.post(c.url + "/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert len(r.json()["output_ids"]) == 8
        for s in c.prefills + c.decodes:
            info = httpx.get(s.url + "/get_server_info", timeout=10).json()
            assert info["disaggregation_transfer_backend"] == "mooncake", info
            assert "transfer backend mooncake (default:" in s.log()
        c.wait_pages_free()
    finally:
        c.stop()
