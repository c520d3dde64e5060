"""Fuzz the generate routes from the servers' own OpenAPI schema (issue 15 acceptance).

Targets, one after the other (never more than two model servers at once): a unified server;
then a prefill + decode pair over tcp behind `pdserve router`, fuzzed through the router and
on each server directly. Two kinds of input:
- schemathesis cases from the OpenAPI schema, valid ones and ones that break it;
- hostile values (lone surrogates, integers past 64 bits, NaN, nesting, wrong types, ...) put
  into one field of an otherwise valid request, for every field the schema names and every
  field `unsupported.py` refuses.
Pass: no 5xx answer (a 504 only for a request that set its own `timeout`), every engine alive
afterwards, every KV pool back to its start. Bounded: a fixed seed (derandomize) and
PDSERVE_FUZZ_EXAMPLES examples per operation and kind (default 25).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from pdserve_testing import ServerProcess
from schemathesis import GenerationMode

from pdcore.server.unsupported import names as unsupported_names
from pdcore.testing.processes import PDCluster

EXAMPLES = int(os.environ.get("PDSERVE_FUZZ_EXAMPLES", "25"))
ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions")
FLAGS = ("--context-length", "128", "--max-total-tokens", "4096", "--max-running-requests", "16")
ENV = {"OMP_NUM_THREADS": "1"}
SETTINGS = settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
                    suppress_health_check=list(HealthCheck), phases=[Phase.generate],
                    print_blob=True)
BASE: dict[str, dict[str, Any]] = {
    "/generate": {"text": "hi", "sampling_params": {"max_new_tokens": 4}},
    "/v1/completions": {"prompt": "hi", "max_tokens": 4},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
}


@dataclass
class Target:
    name: str
    servers: list[ServerProcess]  # the model servers whose pages and engines are checked
    urls: list[str]  # where requests go
    schema_url: str


@pytest.fixture(scope="module", params=["unified", "pd"])
def target(request: pytest.FixtureRequest, tiny_llama_dir: Path) -> Iterator[Target]:
    if request.param == "unified":
        server = ServerProcess("--model-path", str(tiny_llama_dir), *FLAGS, env=ENV)
        try:
            server.wait_healthy(180)
            yield Target("unified", [server], [server.url], server.url + "/openapi.json")
        finally:
            server.stop()
        return
    cluster = PDCluster("tcp", model_path=str(tiny_llama_dir), flags=FLAGS, env=ENV)
    try:
        cluster.start(300)
        servers = cluster.prefills + cluster.decodes
        yield Target("pd", servers, [cluster.url] + [s.url for s in servers],
                     cluster.decodes[0].url + "/openapi.json")
    finally:
        cluster.stop()


def _free_pages(server: ServerProcess) -> int:
    """Pages no request holds: free ones plus unreferenced pages of the prefix cache."""
    load = httpx.get(server.url + "/get_load", timeout=10).json()[0]
    return int(load["num_pages_free"] + load.get("radix_cache_evictable_pages", 0))


def _check(resp_status: int, text: str, body: Any, where: str) -> None:
    own_timeout = isinstance(body, dict) and body.get("timeout") is not None
    if resp_status >= 500 and not (resp_status == 504 and own_timeout):
        shown = json.dumps(body, allow_nan=True)[:1500] if not isinstance(body, str) else body
        raise AssertionError(f"{where} answered {resp_status}: {text[:800]}\nrequest: {shown}")


@pytest.fixture
def intact(target: Target) -> Iterator[None]:
    start = {s.url: _free_pages(s) for s in target.servers}
    yield
    for s in target.servers:
        assert s.alive(), f"{s.url} died:\n{s.log()[-3000:]}"
        health = httpx.get(s.url + "/health", timeout=10)
        assert health.status_code == 200, f"{s.url}: {health.text}\n{s.log()[-3000:]}"
    deadline = time.monotonic() + 30
    while (now := {s.url: _free_pages(s) for s in target.servers}) != start:
        assert time.monotonic() < deadline, f"KV pages not back: {now} != {start}"
        time.sleep(0.2)


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
                         ids=["valid", "invalid"])
@pytest.mark.parametrize("route", ROUTES)
def test_schema_cases(target: Target, intact: None, route: str, mode: GenerationMode) -> None:
    schema = schemathesis.openapi.from_url(target.schema_url)
    operation = schema[route]["POST"]

    @SETTINGS
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case: Any) -> None:
        for url in target.urls:
            resp = case.call(base_url=url, timeout=120)
            _check(resp.status_code, resp.text, case.body, f"{target.name} {url}{route}")

    run()


def _field_names(schema: dict[str, Any]) -> list[str]:
    comps = schema["components"]["schemas"]
    names = set()
    for model in ("GenerateRequest", "CompletionRequest", "ChatCompletionRequest",
                  "SamplingParamsIn"):
        names.update(comps[model]["properties"])
    for group in unsupported_names().values():
        names.update(group)
    return sorted(names)


HOSTILE = st.one_of(
    st.text(alphabet=st.characters(categories=["Cs"]), min_size=1, max_size=3),  # surrogates
    st.integers(min_value=2**63 - 70, max_value=2**70), st.integers(max_value=-(2**63) + 1),
    st.integers(min_value=-(10**6), max_value=10**6),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([None, True, False, "", [], {}, [[[[]]]], ["\ud800"], {"type": "json"},
                     [-1], [2**64], "x" * 5000]),
    st.text(max_size=30),
    st.lists(st.integers(min_value=-5, max_value=60000), max_size=5),
)


def test_hostile_values(target: Target, intact: None) -> None:
    fields = _field_names(httpx.get(target.schema_url, timeout=10).json())
    sampling = set(httpx.get(target.schema_url, timeout=10).json()["components"]["schemas"]
                   ["SamplingParamsIn"]["properties"]) | set(unsupported_names()["sampling_params"])

    @settings(SETTINGS, max_examples=EXAMPLES * 6)
    @given(route=st.sampled_from(ROUTES), field=st.sampled_from(fields), value=HOSTILE,
           nested=st.booleans())
    def run(route: str, field: str, value: Any, nested: bool) -> None:
        body = json.loads(json.dumps(BASE[route]))
        if route == "/generate" and nested and field in sampling:
            body["sampling_params"][field] = value
        elif route == "/v1/chat/completions" and nested:
            body["messages"][0][field] = value
        else:
            body[field] = value
        raw = json.dumps(body, allow_nan=True)  # ensure_ascii: a surrogate travels as \udxxx
        for url in target.urls:
            resp = httpx.post(url + route, content=raw, timeout=120,
                              headers={"content-type": "application/json"})
            _check(resp.status_code, resp.text, body, f"{target.name} {url}{route}")

    run()


def test_router_keeps_4xx(target: Target, intact: None) -> None:
    """Through the router a refused request keeps its status and names its field; a body over
    the limit is refused by the router itself, before any worker sees it."""
    if target.name != "pd":
        pytest.skip("router only")
    router = target.urls[0]
    cases = [("/generate", '{"text": "a \\ud800"}', 400, "text"),
             ("/v1/chat/completions", json.dumps({"messages": [{"role": "wizard", "content": "x"}
                                                               ]}), 400, "messages[0].role"),
             ("/v1/completions", json.dumps({"prompt": "hi", "tools": [{"type": "function"}]}),
              400, "tools"),
             ("/generate", json.dumps({"text": "hi", "return_logprob": True,
                                       "top_logprobs_num": 10**5}), 400, "top_logprobs_num"),
             ("/generate", json.dumps({"text": "w" * (5 << 20)}), 413, "body")]
    for route, raw, status, field in cases:
        resp = httpx.post(router + route, content=raw, timeout=60,
                          headers={"content-type": "application/json"})
        assert resp.status_code == status, resp.text[:500]
        assert field in resp.text, resp.text[:500]
