"""Strict request schemas (#30 item 4), on a server (the echo scheduler behind the real HTTP app on
loopback) and on our router in front of it: a number must be a JSON number, every bound applies
to what was parsed, and JSON nested too deep is a 400 on every route of both.

Before: `"top_logprobs_num": "40000"` returned a 21 MB body for 16 tokens, `"n": "64"` with 8
prompts served 512 samples (limit 256), `"timeout": "-1"` gave 504, a huge string `seed` gave 500
and 200,000-deep JSON a 500 from the router."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fake_server import FakeServer, ServerThread, wait_status

from pdcore.router.app import create_app as create_router
from pdcore.router.config import RouterConfig
from pdcore.edge.limits import MAX_JSON_DEPTH

pytestmark = pytest.mark.usefixtures("pages_back")

PROMPTS = [f"prompt {i}" for i in range(8)]
# (route, body, the field the 400 must name)
STRING_NUMBERS = [
    ("/generate", {"text": "hi", "top_logprobs_num": "40000", "return_logprob": True,
                   "sampling_params": {"max_new_tokens": 16}}, "top_logprobs_num"),
    ("/generate", {"text": PROMPTS, "sampling_params": {"n": "64"}}, "sampling_params.n"),
    ("/generate", {"text": "hi", "timeout": "-1"}, "timeout"),
    ("/generate", {"text": "hi", "sampling_params": {"seed": "9" * 5000}},
     "sampling_params.seed"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": "4"}},
     "sampling_params.max_new_tokens"),
    ("/generate", {"text": "hi", "sampling_params": {"temperature": "0"}},
     "sampling_params.temperature"),
    ("/generate", {"input_ids": [1, 2, "3"]}, "input_ids[2]"),
    ("/generate", {"text": PROMPTS, "sampling_params": {"n": 64.0}}, "sampling_params.n"),
    ("/generate", {"text": "hi", "sampling_params": {"n": True}}, "sampling_params.n"),
    ("/v1/completions", {"prompt": PROMPTS, "n": "64"}, "n"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "16"}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "logprobs": "5"}, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "top_logprobs": "19", "logprobs": True}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "timeout": "-1"}, "timeout"),
]
# what clients do send: integers for float fields, null for unset options
FINE = [
    ("/generate", {"text": "hi", "sampling_params": {"temperature": 0, "top_p": 1,
                                                     "max_new_tokens": 4, "seed": None}}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "temperature": 0, "top_p": 1.0}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                              "temperature": 1, "presence_penalty": 0, "seed": 7}),
]


def _router_config(server: FakeServer) -> RouterConfig:
    return RouterConfig(pd_disaggregation=True, prefill=[(server.url, None)],
                        decode=[server.url.replace("127.0.0.1", "localhost")],
                        policy="round_robin")


@pytest.fixture(scope="module")
def router(fake_server: FakeServer) -> Iterator[httpx.Client]:
    # the one server as both workers (two spellings of its address): every case here is
    # refused before any worker is called
    config = _router_config(fake_server)
    thread = ServerThread(create_router(config)).start()
    client = httpx.Client(base_url=thread.url, timeout=30)
    wait_status(client, "/health")
    yield client
    client.close()
    thread.stop()


def _refused(resp: httpx.Response, field: str) -> None:
    assert resp.status_code == 400, (field, resp.status_code, resp.text[:300])
    err = resp.json()["error"]
    assert err["param"] == field and err["type"] == "invalid_request_error", err
    assert field.split(".")[-1].split("[")[0] in err["message"], err


@pytest.mark.parametrize("route,body,field", STRING_NUMBERS,
                         ids=[f"{r}:{f}" for r, _, f in STRING_NUMBERS])
def test_a_number_must_be_a_json_number_on_the_server(fake_server, route, body, field) -> None:
    before = len(fake_server.last_requests())
    resp = fake_server.client.post(route, json=body)
    _refused(resp, field)
    assert "JSON number" in resp.text or "valid integer" in resp.text or "valid number" in resp.text
    assert len(fake_server.last_requests()) == before, "the scheduler saw a refused request"


@pytest.mark.parametrize("route,body,field", STRING_NUMBERS,
                         ids=[f"{r}:{f}" for r, _, f in STRING_NUMBERS])
def test_the_router_refuses_what_the_servers_refuse(fake_server, router, route, body,
                                                    field) -> None:
    before = len(fake_server.last_requests())
    _refused(router.post(route, json=body), field)
    assert len(fake_server.last_requests()) == before, "a worker saw a refused request"


@pytest.mark.parametrize("route,body", FINE, ids=[r for r, _ in FINE])
def test_numbers_clients_send_still_work(fake_server, route, body) -> None:
    resp = fake_server.client.post(route, json=body)
    assert resp.status_code == 200, resp.text


def _post_routes(app: Any) -> list[str]:
    """Every path of the app that takes a body (included routers too)."""
    paths, todo = [], list(app.routes)
    while todo:
        r = todo.pop()
        inner = getattr(r, "original_router", None)  # FastAPI's included router
        if inner is not None:
            todo.extend(inner.routes)
            continue
        methods = getattr(r, "methods", None) or set()
        if methods & {"POST", "PUT", "PATCH", "DELETE"} and "{" not in r.path:
            paths.append(r.path)
    return sorted(set(paths))


@pytest.mark.parametrize("depth", [200_000, MAX_JSON_DEPTH + 1])
def test_deep_json_is_a_400_on_every_route(fake_server, router, depth) -> None:
    deep = b"[" * depth + b"]" * depth
    nested = b'{"text": ' + b'{"a": ' * depth + b"1" + b"}" * depth + b"}"
    router_paths = _post_routes(create_router(_router_config(fake_server)))
    assert "/workers" in router_paths
    servers = [(fake_server.client, _post_routes(fake_server.app), "server"),
               (router, router_paths, "router")]
    for client, paths, who in servers:
        assert "/generate" in paths and "/v1/chat/completions" in paths
        for path in paths:
            for raw in (deep, nested):
                resp = client.post(path, content=raw, headers={"content-type": "application/json"})
                if resp.status_code == 405:  # a DELETE-only path: send the body that way
                    resp = client.request("DELETE", path, content=raw,
                                          headers={"content-type": "application/json"})
                assert resp.status_code == 400, (who, path, resp.status_code, resp.text[:200])
                assert "nested" in resp.json()["error"]["message"], (who, path, resp.text)
    # shallow enough: a route gets the body (and may say something else about it)
    ok = fake_server.client.post("/generate", json={"text": "hi", "sampling_params": {
        "max_new_tokens": 2}, "extra": [[[[1]]]]})
    assert ok.status_code == 200, ok.text
