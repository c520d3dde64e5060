"""Client and server plumbing of bench/prefix_cache.py: streamed native /generate requests that
keep TTFT, output ids and the cached-token count of each reply; a `Fleet` owning every server
and router a run starts (all stopped on the way out, failure included); /get_load counter
deltas and /flush_cache."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
from dataclasses import dataclass, field
from typing import Any, Self

import httpx
from common import ratio
from serving import sse_lines

from pdcore.testing.processes import PDCluster, ServerProcess, free_port

# /get_load keys whose change over a phase is recorded (transfer and cache counters)
_DELTA_WORDS = ("bytes", "cache", "cached", "reuse", "transfer", "prompt_tokens")


# -- client ------------------------------------------------------------------------------------
@dataclass
class Reply:
    prompt_len: int
    start: float
    ttft: float | None = None  # s from send to the first chunk carrying an output token
    end: float | None = None
    output_ids: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    prompt_tokens: int = 0
    error: str | None = None


async def generate(client: httpx.AsyncClient, url: str, ids: list[int], max_new: int,
                   timeout: float = 600.0) -> Reply:
    """One streamed, greedy, ignore_eos native /generate; errors are recorded, not raised."""
    body = {"input_ids": ids, "stream": True, "sampling_params": {
        "temperature": 0.0, "max_new_tokens": max_new, "ignore_eos": True}}
    res = Reply(len(ids), time.perf_counter())
    try:
        async with client.stream("POST", url + "/generate", json=body, timeout=timeout) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
                return res
            async for line in sse_lines(r.aiter_text()):
                data = line[5:].strip() if line.startswith("data:") else ""
                if not data or data == "[DONE]":
                    continue
                msg = json.loads(data)
                if "error" in msg:
                    res.error = str(msg["error"])[:300]
                    break
                if msg.get("output_ids"):
                    res.ttft = res.ttft or time.perf_counter() - res.start
                    res.output_ids = list(msg["output_ids"])
                meta = msg.get("meta_info") or {}
                res.cached_tokens = int(meta.get("cached_tokens") or 0)
                res.prompt_tokens = int(meta.get("prompt_tokens") or 0)
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
    finally:
        res.end = time.perf_counter()
    return res


async def run_all(url: str, prompts: list[list[int]], max_new: int, concurrency: int
                  ) -> list[Reply]:
    """Every prompt, at most `concurrency` in flight, started in list order; replies in the
    same order. Any failed request fails the phase (its numbers would mean nothing)."""
    sem = asyncio.Semaphore(concurrency)
    out: list[Reply] = []
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=concurrency + 2)) as client:
        async def one(ids: list[int]) -> Reply:
            async with sem:
                return await generate(client, url, ids, max_new)

        out = list(await asyncio.gather(*(one(p) for p in prompts)))
    failed = [r.error for r in out if r.error]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(out)} requests to {url} failed: {failed[:3]}")
    return out


def hit_stats(replies: list[Reply]) -> dict[str, Any]:
    cached, prompt = sum(r.cached_tokens for r in replies), sum(r.prompt_tokens for r in replies)
    return {"cached_tokens": cached, "prompt_tokens": prompt, "hit_rate": ratio(cached, prompt)}


# -- servers -----------------------------------------------------------------------------------
class Fleet:
    """Every server and router this run starts; leaving the `with` block stops all of them."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.env = {"OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads),
                    "OMP_WAIT_POLICY": "PASSIVE"}
        self.procs: list[ServerProcess] = []
        self.bootstrap: dict[str, int] = {}  # prefill url -> bootstrap port

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        for p in reversed(self.procs):
            with contextlib.suppress(Exception):
                p.stop()
        self.procs.clear()

    def server(self, mode: str, *flags: str) -> ServerProcess:
        """Spawned, not waited for (several load their models at once)."""
        a = self.args
        common = ["--max-total-tokens", str(a.max_total_tokens), "--page-size", str(a.page_size),
                  *a.server_flag, *flags]
        if a.model_path:
            common += ["--model-path", a.model_path]
        bport = None
        if mode != "unified":
            common += ["--disaggregation-mode", mode, "--disaggregation-transfer-backend",
                       a.backend]
        if mode == "prefill":
            bport = free_port()
            common += ["--disaggregation-bootstrap-port", str(bport)]
        s = ServerProcess(*common, env=self.env)
        self.procs.append(s)
        if bport is not None:
            self.bootstrap[s.url] = bport
        return s

    def ready(self, *servers: ServerProcess) -> None:
        for s in servers:
            s.wait_healthy(self.args.start_timeout)

    def stop(self, *servers: ServerProcess) -> None:
        for s in servers:
            s.stop()
            self.procs.remove(s)

    def router(self, prefills: list[ServerProcess], decode: ServerProcess, policy: str
               ) -> PDCluster:
        """Our router over running workers (their lifetimes stay the fleet's)."""
        c = PDCluster(self.args.backend, prefill=0, decode=0, env=self.env, policy=policy)
        c.prefills, c.decodes = list(prefills), [decode]
        c.bootstrap_ports = [self.bootstrap[p.url] for p in prefills]
        c.start(self.args.start_timeout)  # the workers answer already: starts the router
        self.procs.append(c.router)
        return c

    def unroute(self, c: PDCluster) -> None:
        if c.router is not None:
            self.stop(c.router)


def load(server: ServerProcess) -> dict[str, Any]:
    data = httpx.get(server.url + "/get_load", timeout=30).json()
    return data[0] if isinstance(data, list) else data


def counters(servers: list[ServerProcess]) -> dict[str, float]:
    """Sum over `servers` of their numeric /get_load values named in _DELTA_WORDS (rates and
    per-request averages left out: their sum or change means nothing)."""
    out: dict[str, float] = {}
    for s in servers:
        for k, v in load(s).items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and \
                    any(w in k for w in _DELTA_WORDS) and not k.endswith(("_rate", "_request")):
                out[k] = out.get(k, 0) + v
    return out


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def flush(*servers: ServerProcess, timeout: float = 30.0) -> None:
    """POST /flush_cache on each; a refusal (requests still running) is retried until
    `timeout`."""
    for s in servers:
        deadline = time.monotonic() + timeout
        while True:
            r = httpx.post(s.url + "/flush_cache", timeout=30, headers=s.admin_headers)
            if r.status_code == 200:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{s.url}/flush_cache kept refusing: {r.text[:300]}")
            time.sleep(0.2)
