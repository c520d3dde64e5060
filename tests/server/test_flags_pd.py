"""--api-key and --kv-cache-dtype across a real prefill + decode pair and our router (tcp backend,
tiny random Llama, loopback)."""

from __future__ import annotations

import time

import httpx
import pytest

from pdcore.testing.pages import load_at_rest
from pdcore.testing.processes import PDCluster, ServerProcess

KEY = "sk-pd-key"
BODY = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 6,
                                                                 "temperature": 0}}


def _router(cluster: PDCluster, *flags: str) -> ServerProcess:
    args: list[str] = ["--pd-disaggregation", "--policy", "round_robin",
                       "--health-check-interval-secs", "1", *flags]
    for s, b in zip(cluster.prefills, cluster.bootstrap_ports):
        args += ["--prefill", s.url, str(b)]
    for s in cluster.decodes:
        args += ["--decode", s.url]
    return ServerProcess(*args, command=("-m", "pdcore.router"), env=cluster.env)


def _start(cluster: PDCluster, *router_flags: str) -> None:
    for s in cluster.prefills + cluster.decodes:
        s.wait_healthy(300)
    cluster.router = _router(cluster, *router_flags).wait_healthy(120)


def test_api_key_through_the_router_with_bfloat16_kv(tiny_llama_dir):
    cluster = PDCluster("tcp", model_path=str(tiny_llama_dir),
                        flags=("--api-key", KEY, "--kv-cache-dtype", "bfloat16"))
    try:
        _start(cluster, "--api-key", KEY)
        url = cluster.url
        assert httpx.get(url + "/health").status_code == 200
        for path in ("/generate", "/v1/completions"):
            r = httpx.post(url + path, json=BODY if path == "/generate" else
                           {"prompt": "hi", "max_tokens": 2})
            assert r.status_code == 401, r.text
        for path in ("/get_loads", "/workers", "/metrics"):
            assert httpx.get(url + path).status_code == 401, path
        headers = {"Authorization": f"Bearer {KEY}"}
        r = httpx.post(url + "/generate", json=BODY, headers=headers, timeout=120)
        assert r.status_code == 200, r.text
        assert len(r.json()["output_ids"]) >= 1
        # the router's own calls to the workers carry the key too (loads, server info)
        loads = httpx.get(url + "/get_loads", headers=headers, timeout=30)
        assert loads.status_code == 200, loads.text
        # #44: the API key is no admin key: an API user adds no worker, trusts no address
        rogue = {"url": "http://127.0.0.1:9", "worker_type": "decode"}
        r = httpx.post(url + "/workers", json=rogue, headers=headers, timeout=10)
        assert r.status_code == 403 and "--admin-api-key" in r.text, r.text
        assert "http://127.0.0.1:9" not in httpx.get(url + "/workers", headers=headers).text
        d = cluster.decodes[0].url + "/disaggregation/trusted_prefill"
        r = httpx.post(d, json={"add": ["127.0.0.1:9"]}, headers=headers, timeout=10)
        assert r.status_code == 403, r.text
        assert "127.0.0.1:9" not in httpx.get(d, headers=headers, timeout=10).json()["trusted"]
        # the workers themselves refuse a keyless caller
        for s in cluster.prefills + cluster.decodes:
            assert httpx.get(s.url + "/get_load").status_code == 401
            info = httpx.get(s.url + "/get_server_info", headers=headers).json()
            assert info["kv_cache_dtype"] == "bfloat16"
            deadline = time.monotonic() + 30
            while True:  # P frees its pages when the transfer completes, maybe just after
                load = httpx.get(s.url + "/get_load", headers=headers).json()[0]
                if load_at_rest(load):
                    break
                assert time.monotonic() < deadline, load
                time.sleep(0.2)
    finally:
        cluster.stop()


@pytest.mark.parametrize("p_dtype,d_dtype", [("bfloat16", "float32")])
def test_different_kv_dtypes_are_refused_clearly(tiny_llama_dir, p_dtype, d_dtype):
    cluster = PDCluster("tcp", model_path=str(tiny_llama_dir),
                        prefill_flags=("--kv-cache-dtype", p_dtype),
                        decode_flags=("--kv-cache-dtype", d_dtype))
    try:
        _start(cluster, "--disable-retries")
        r = httpx.post(cluster.url + "/generate", json=BODY, timeout=120)
        assert r.status_code >= 400, r.text
        assert "KV dtype" in r.text and "--kv-cache-dtype" in r.text, r.text
        # both engines stay up and nothing leaks
        for s in cluster.prefills + cluster.decodes:
            assert s.alive() and httpx.get(s.url + "/health").status_code == 200
        cluster.wait_pages_free()
    finally:
        cluster.stop()
