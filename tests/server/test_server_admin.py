"""Operational routes against the echo stand-in scheduler."""

from __future__ import annotations

import os

import pytest
from pdserve_testing import ADMIN_HEADERS

pytestmark = pytest.mark.usefixtures("pages_back")


def test_health_and_health_generate(fake_server):
    c = fake_server.client
    assert c.get("/health").status_code == 200
    before = len(fake_server.last_requests())
    assert c.get("/health_generate").status_code == 200
    req = fake_server.last_requests()[-1]
    assert len(fake_server.last_requests()) == min(before + 1, 64)
    assert req["rid"].startswith("health-") and req["sampling"]["max_new_tokens"] == 1
    assert req["route"] is None  # unified mode: no route, no fake bootstrap host


@pytest.mark.parametrize("path", ["/get_server_info", "/server_info"])
def test_server_info(fake_server, path):
    info = fake_server.client.get(path).json()
    assert info["model_path"] == os.path.abspath(fake_server.args.model_path)
    assert os.path.isdir(info["tokenizer_path"])
    for key in ("disaggregation_mode", "tp_size", "dp_size", "context_length", "page_size",
                "max_total_tokens", "served_model_name", "version", "chunked_prefill_size"):
        assert key in info, key
    assert (info["disaggregation_mode"], info["tp_size"], info["dp_size"]) == ("null", 1, 1)
    assert info["status"] == "ready"


@pytest.mark.parametrize("path", ["/get_model_info", "/model_info"])
def test_model_info(fake_server, path):
    info = fake_server.client.get(path).json()
    assert info["is_generation"] is True and info["model_type"] == "llama"
    assert info["architectures"] == ["LlamaForCausalLM"]
    assert os.path.isdir(info["model_path"]) and info["served_model_name"]


def test_get_load_is_a_list_of_dp_dicts(fake_server):
    loads = fake_server.client.get("/get_load").json()
    assert isinstance(loads, list) and len(loads) == 1
    assert {"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens"} <= set(loads[0])
    assert loads[0]["dp_rank"] == 0 and loads[0]["num_reqs"] == 0


def test_flush_cache_post_and_get(fake_server):
    for method in ("POST", "GET"):
        r = fake_server.client.request(method, "/flush_cache", headers=ADMIN_HEADERS)
        assert r.status_code == 200 and r.json()["success"] is True


def test_profile_routes(fake_server, tmp_path):
    r = fake_server.client.post("/start_profile", json={"output_dir": str(tmp_path)},
                                headers=ADMIN_HEADERS)
    assert r.status_code == 200 and r.json()["args"]["output_dir"] == str(tmp_path)
    r = fake_server.client.post("/stop_profile", headers=ADMIN_HEADERS)
    assert r.status_code == 200
    bad = fake_server.client.post("/start_profile", content=b"{x", headers=ADMIN_HEADERS)
    assert bad.status_code == 400


def _sample(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith((name + " ", name + "{")):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} missing from /metrics")


def test_metrics(fake_server):
    c = fake_server.client
    before = c.get("/metrics").text
    r = c.post("/generate", json={"text": "count these tokens", "sampling_params":
                                  {"max_new_tokens": 3}})
    assert r.status_code == 200
    c.post("/generate", json={"text": "x", "sampling_params": {"temperature": -1}})
    after = c.get("/metrics")
    assert after.headers["content-type"].startswith("text/plain")
    text = after.text
    assert _sample(text, "sglang:generation_tokens_total") - \
        _sample(before, "sglang:generation_tokens_total") == 3
    assert _sample(text, "sglang:prompt_tokens_total") - \
        _sample(before, "sglang:prompt_tokens_total") == len(
            fake_server.tokenizer.encode("count these tokens"))
    assert _sample(text, "sglang:time_to_first_token_seconds_count") >= 1
    assert _sample(text, "sglang:inter_token_latency_seconds_count") >= 2
    assert 'pdserve_requests_total{route="/generate",status="200"}' in text
    assert 'pdserve_requests_total{route="/generate",status="400"}' in text
    assert _sample(text, "pdserve_kv_pages_free") == fake_server.free_pages()
    assert _sample(text, "pdserve_kv_pages_used") == 0
    assert _sample(text, "sglang:num_running_reqs") == 0
