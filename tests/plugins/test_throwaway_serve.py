"""A third-party memory pool, installed as its own distribution, is listed by `pdserve plugins`
and used by `pdserve serve --memory-pool` to hold the KV pool."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx

from pdcore.testing.processes import ServerProcess
from pdcore.testing.tiny_models import make_tiny_model


def test_serve_uses_third_party_pool(throwaway_pool_plugin, tmp_path):
    listed = subprocess.run([sys.executable, "-m", "pdcore", "plugins", "--json"],
                            capture_output=True, text=True, timeout=120, check=False)
    assert listed.returncode == 0, listed.stderr
    entries = json.loads(listed.stdout)
    assert throwaway_pool_plugin in json.dumps(entries)
    from pdcore.engine.model.tokenizer import default_model_file

    model = make_tiny_model(str(tmp_path / "m"), tokenizer_from=default_model_file())
    server = ServerProcess("--model-path", model, "--memory-pool", throwaway_pool_plugin,
                           "--max-total-tokens", "1024")
    try:
        server.wait_healthy(180)
        info = httpx.get(server.url + "/get_server_info", timeout=10).json()
        assert throwaway_pool_plugin in json.dumps(info)
        r = httpx.post(server.url + "/generate", json={
            "input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3, "temperature": 0,
                                                        "ignore_eos": True}}, timeout=60)
        assert r.status_code == 200, r.text
        assert len(r.json()["output_ids"]) == 3
    finally:
        server.stop()
