"""Client helpers for PD end-to-end tests (the router is what clients talk to)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

GREEDY = {"temperature": 0.0, "max_new_tokens": 48}


def generate(url: str, ids: list[int], stream: bool = False, timeout: float = 300.0,
             **extra: Any) -> dict[str, Any]:
    body = {"input_ids": ids, "sampling_params": dict(GREEDY), "stream": stream, **extra}
    if not stream:
        r = httpx.post(url + "/generate", json=body, timeout=timeout)
        assert r.status_code == 200, r.text
        return r.json()
    last = None
    with httpx.stream("POST", url + "/generate", json=body, timeout=timeout) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                last = json.loads(line[6:])
                assert "error" not in last, last
    assert last is not None
    return last


def generate_all(url: str, prompts: list[list[int]], **kw: Any) -> list[dict[str, Any]]:
    with ThreadPoolExecutor(len(prompts)) as ex:
        return list(ex.map(lambda p: generate(url, p, **kw), prompts))


def assert_same_tokens(got: list[dict[str, Any]], unified: list[dict[str, Any]]) -> None:
    for i, (g, u) in enumerate(zip(got, unified)):
        assert g["output_ids"] == u["output_ids"], f"prompt {i}: PD differs from unified"
