"""--api-key and --kv-cache-dtype across a real prefill + decode pair and our router (tcp backend,
tiny random Llama, loopback): bf16 and FP8 KV pages cross at their own bytes per token (from the
transfer metrics; FP8's half of bf16's), a 1P1D FP8-KV run's greedy tokens are the unified
FP8-KV engine's, and a pair whose KV dtypes differ is refused naming both."""

from __future__ import annotations

import time

import httpx
import pytest

from pdcore.testing.pages import load_at_rest

NEW = 12
PROMPTS = [[(i * 7919 + n) % 40000 + 3 for i in range(n)] for n in (7, 29)]
BYTES = "pdserve_kv_transfer_bytes_total"  # P: KV bytes it wrote; D: bytes received
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


def _metric(url: str, name: str, headers: dict | None = None) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", headers=headers, timeout=30).text
    samples = [x.value for f in text_string_to_metric_families(text) for x in f.samples
               if x.name == name]
    assert samples, f"{name} not in {url}/metrics"
    return sum(samples)


def _bytes_per_token(cluster: PDCluster, send, headers: dict | None = None) -> list[float]:
    """KV bytes per transferred token on P and on D for the requests `send()` makes (it
    returns their prompt lengths), from the transfer counters."""
    servers = cluster.prefills + cluster.decodes
    before = [_metric(s.url, BYTES, headers) for s in servers]
    lens = send()
    deadline = time.monotonic() + 30
    for srv in servers:  # every transfer done (P frees its pages when D has them)
        while not load_at_rest(httpx.get(srv.url + "/get_load", headers=headers).json()[0]):
            assert time.monotonic() < deadline, srv.url
            time.sleep(0.2)
    page = httpx.get(servers[0].url + "/get_server_info", headers=headers,
                     timeout=30).json()["page_size"]
    tokens = sum(-(-n // page) * page for n in lens)  # whole pages cross
    return [(_metric(s.url, BYTES, headers) - b) / tokens for s, b in zip(servers, before)]


def _start(cluster: PDCluster, *router_flags: str) -> None:
    for s in cluster.prefills + cluster.decodes:
        s.wait_healthy(300)
    cluster.router = _router(cluster, *router_flags).wait_healthy(120)


def _greedy(ids: list[int]) -> dict:
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": NEW, "temperature": 0,
                                                  "ignore_eos": True}}


def test_api_key_through_the_router_with_fp8_kv(tiny_llama_dir):
    """#48: FP8 KV pages cross at half of bf16's bytes per token (P wrote, D received: the
    transfer counters), and the 1P1D greedy tokens are the unified FP8-KV engine's."""
    import torch

    from pdcore.engine.kv.cache import KVCache

    cluster = PDCluster("tcp", model_path=str(tiny_llama_dir),
                        flags=("--api-key", KEY, "--kv-cache-dtype", "fp8_e4m3"))
    pd_ids: list[list[int]] = []
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

        def send() -> list[int]:
            r = httpx.post(url + "/generate", json=BODY, headers=headers, timeout=120)
            assert r.status_code == 200, r.text
            assert len(r.json()["output_ids"]) >= 1
            lens = [r.json()["meta_info"]["prompt_tokens"]]
            for ids in PROMPTS:
                r = httpx.post(url + "/generate", json=_greedy(ids), headers=headers,
                               timeout=120)
                assert r.status_code == 200, r.text
                pd_ids.append(r.json()["output_ids"])
            return lens + [len(p) for p in PROMPTS]

        per_token = _bytes_per_token(cluster, send, headers)
        info = httpx.get(cluster.prefills[0].url + "/get_server_info", headers=headers).json()
        bf16 = KVCache.bytes_per_token(2, 2, 16, torch.bfloat16)  # the tiny Llama's geometry
        assert per_token == [bf16 / 2] * 2 == [info["kv_bytes_per_token"]] * 2, per_token
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
            assert info["kv_cache_dtype"] == "float8_e4m3fn"
            deadline = time.monotonic() + 30
            while True:  # P frees its pages when the transfer completes, maybe just after
                load = httpx.get(s.url + "/get_load", headers=headers).json()[0]
                if load_at_rest(load):
                    break
                assert time.monotonic() < deadline, load
                time.sleep(0.2)
    finally:
        cluster.stop()
    _same_as_unified(tiny_llama_dir, pd_ids)


def _same_as_unified(model, pd_ids: list[list[int]]) -> None:
    """The unified FP8-KV engine of the same model (in process) answers PROMPTS as 1P1D did."""
    from pdcore.config import ServerArgs
    from pdcore.messages.io import SamplingParams
    from pdcore.runtime.llm_engine import LLMEngine

    eng = LLMEngine(ServerArgs(model_path=str(model), kv_cache_dtype="fp8_e4m3",
                               max_total_tokens=1024, log_level="warning"))
    try:
        sp = SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)
        assert [o["output_ids"] for o in eng.generate(PROMPTS, sp)] == pd_ids
    finally:
        eng.close()


@pytest.mark.parametrize("p_dtype,d_dtype", [("bfloat16", "fp8_e4m3")])
def test_different_kv_dtypes_are_refused_clearly(tiny_llama_dir, p_dtype, d_dtype):
    cluster = PDCluster("tcp", model_path=str(tiny_llama_dir),
                        prefill_flags=("--kv-cache-dtype", p_dtype),
                        decode_flags=("--kv-cache-dtype", d_dtype))
    try:
        _start(cluster, "--disable-retries")
        r = httpx.post(cluster.url + "/generate", json=BODY, timeout=120)
        assert r.status_code >= 400, r.text
        assert "KV dtype" in r.text and "--kv-cache-dtype" in r.text, r.text
        assert "bfloat16" in r.text and "float8_e4m3fn" in r.text, r.text  # both named
        # both engines stay up and nothing leaks
        for s in cluster.prefills + cluster.decodes:
            assert s.alive() and httpx.get(s.url + "/health").status_code == 200
        cluster.wait_pages_free()
    finally:
        cluster.stop()
