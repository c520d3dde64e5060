"""The common SGLang flags work on real servers (tiny random Llama, loopback): --api-key,
--log-requests, --chat-template, --kv-cache-dtype, warm-up and --skip-server-warmup,
--random-seed with --load-format dummy, --enable-metrics, and the KV pool size rule."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pdcore.testing.processes import ServerProcess

KEY = "sk-test-key"
TEMPLATE = ("{% for m in messages %}TEMPLATE-MARK {{ m['role'] }}: {{ m['content'] }}\n"
            "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.fixture(scope="module")
def keyed_server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[ServerProcess]:
    template = tmp_path_factory.mktemp("tpl") / "chat.jinja"
    template.write_text(TEMPLATE)
    server = ServerProcess("--model-path", str(tiny_llama_dir), "--api-key", KEY,
                           "--log-requests", "--chat-template", str(template),
                           "--kv-cache-dtype", "bfloat16", "--enable-metrics",
                           "--max-total-tokens", "1000", "--page-size", "4")
    try:
        yield server.wait_healthy(180)
    finally:
        server.stop()


def auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_api_key_guards_every_route_but_health(keyed_server):
    url = keyed_server.url
    assert httpx.get(url + "/health").status_code == 200
    for method, path, body in [("GET", "/v1/models", None), ("GET", "/metrics", None),
                               ("GET", "/get_server_info", None),
                               ("POST", "/generate", {"text": "hi"}),
                               ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2})]:
        for headers in ({}, auth("wrong"), {"Authorization": KEY}):
            r = httpx.request(method, url + path, json=body, headers=headers)
            assert r.status_code == 401, (path, headers, r.text)
            assert "API key" in r.json()["error"]["message"]
        r = httpx.request(method, url + path, json=body, headers=auth())
        assert r.status_code == 200, (path, r.text)
    info = httpx.get(url + "/get_server_info", headers=auth()).json()
    assert info["api_key"] == "***"  # the secret is not served back


def test_log_requests_one_line_per_request(keyed_server):
    r = httpx.post(keyed_server.url + "/generate", headers=auth(), json={
        "input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3, "temperature": 0,
                                                     "ignore_eos": True}, "rid": "logged-rid-1"})
    assert r.status_code == 200, r.text
    lines = [ln for ln in keyed_server.log().splitlines() if "request logged-rid-1:" in ln]
    assert len(lines) == 1, lines
    assert "3 prompt tokens, 3 output tokens" in lines[0] and " ms, finished (length)" in lines[0]


def test_chat_template_file_is_used(keyed_server, tiny_llama_dir):
    from transformers import AutoTokenizer

    msgs = [{"role": "user", "content": "hello there"}]
    r = httpx.post(keyed_server.url + "/v1/chat/completions", headers=auth(),
                   json={"messages": msgs, "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    rendered = "TEMPLATE-MARK user: hello there\nassistant:"
    tok = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    expected = len(tok(rendered, add_special_tokens=False)["input_ids"])
    default = len(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True))
    assert expected != default  # the check below can tell the two templates apart
    assert r.json()["usage"]["prompt_tokens"] == expected


def test_kv_cache_dtype_and_real_max_model_len(keyed_server):
    info = httpx.get(keyed_server.url + "/get_server_info", headers=auth()).json()
    assert info["kv_cache_dtype"] == "bfloat16" and info["dtype"] == "float32"
    assert info["max_total_tokens"] == 1000
    models = httpx.get(keyed_server.url + "/v1/models", headers=auth()).json()
    # the model allows 8192 positions, the pool holds 1000 tokens: 1000 is what can be served
    assert models["data"][0]["max_model_len"] == 1000 == info["context_length"]
    r = httpx.post(keyed_server.url + "/generate", headers=auth(),
                   json={"input_ids": list(range(3, 1003)), "sampling_params": {
                       "max_new_tokens": 2}})
    assert r.status_code == 400, r.text  # longer than the servable context: refused
    r = httpx.post(keyed_server.url + "/generate", headers=auth(), json={
        "input_ids": list(range(3, 40)), "sampling_params": {"max_new_tokens": 8,
                                                              "temperature": 0}})
    assert r.status_code == 200 and len(r.json()["output_ids"]) >= 1, r.text


def test_warm_up_runs_before_ready(keyed_server):
    log = keyed_server.log()
    assert "warm-up generate done in" in log
    ready = log.index("pdserve ready at")
    assert log.index("warm-up generate done in") < ready


def _sample(server: ServerProcess) -> list[int]:
    r = httpx.post(server.url + "/generate", json={
        "input_ids": [3, 4, 5, 6], "sampling_params": {"max_new_tokens": 12, "temperature": 1.0,
                                                        "ignore_eos": True}}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def test_random_seed_and_dummy_weights(tiny_llama_dir, tmp_path):
    # a folder with the config and tokenizer only: --load-format dummy needs no weight file
    model = tmp_path / "config_only"
    model.mkdir()
    for f in tiny_llama_dir.iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, model / f.name)
    assert json.loads((model / "config.json").read_text())["num_hidden_layers"] == 2
    flags = ("--model-path", str(model), "--load-format", "dummy", "--skip-server-warmup",
             "--max-total-tokens", "512")
    runs = []
    servers = []  # started at once: three start-ups side by side, not one after another
    try:
        for seed in ("7", "7", "8"):
            servers.append(ServerProcess(*flags, "--random-seed", seed))
        for server in servers:
            server.wait_healthy(180)
            runs.append(_sample(server))
            log = server.log()
            assert "random weights (--load-format dummy)" in log
            assert "warm-up skipped (--skip-server-warmup)" in log
            assert "warm-up generate done" not in log
    finally:
        for server in servers:
            server.stop()
    assert runs[0] == runs[1]  # same seed: same weights and the same unseeded samples
    assert runs[0] != runs[2]


def test_kv_pool_size_does_not_follow_free_memory():
    import torch

    from pdcore.config import ServerArgs
    from pdcore.engine.build import kv_pool_tokens
    from pdcore.interfaces.platform import MemoryInfo

    class Host:
        def __init__(self, free: int) -> None:
            self.free = free

        def memory_info(self, device: torch.device) -> MemoryInfo:
            return MemoryInfo(free_bytes=self.free, total_bytes=16 << 30)

    model = torch.nn.Linear(1024, 1024)  # 4 MiB of weights
    args = ServerArgs(max_running_requests=1000)
    sizes = {kv_pool_tokens(args, Host(free), torch.device("cpu"), model, 4096, 8192)
             for free in (15 << 30, 3 << 30, 1 << 30)}
    expected = (int((16 << 30) * 0.1) - 1024 * 1025 * 4) // 4096
    assert sizes == {expected}
    # capped at what every running request's whole context could hold
    small = ServerArgs(max_running_requests=2)
    assert kv_pool_tokens(small, Host(1 << 30), torch.device("cpu"), model, 4096, 8192) == 16384
