"""bench/vllm_pd_proxy.py speaks vLLM's disaggregation protocol: checked against two loopback
HTTP servers that record what they receive and answer as vLLM's prefill / decode servers do
(the real vLLM pair runs in bench/vs_vllm.py, which CI cannot install)."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from vllm_pd_proxy import make_app

PARAMS = {"remote_engine_id": "e1", "remote_block_ids": [3, 4], "remote_host": "127.0.0.1",
          "remote_port": 5600, "do_remote_prefill": True, "do_remote_decode": False}


async def serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


def upstream(seen: list[dict[str, Any]], role: str, with_params: bool = True) -> web.Application:
    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append(body)
        if role == "prefill":
            answer: dict[str, Any] = {"choices": [{"text": "x"}]}
            if with_params:
                answer["kv_transfer_params"] = PARAMS
            return web.json_response(answer)
        if not body.get("stream"):
            return web.json_response({"choices": [{"text": "abc"}]})
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for piece in ("a", "b"):
            await out.write(f"data: {json.dumps({'choices': [{'text': piece}]})}\n\n".encode())
        await out.write(b"data: [DONE]\n\n")
        return out

    async def health(_: web.Request) -> web.Response:
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", health)
    return app


async def scenario(with_params: bool) -> dict[str, Any]:
    pseen: list[dict[str, Any]] = []
    dseen: list[dict[str, Any]] = []
    pr, purl = await serve(upstream(pseen, "prefill", with_params))
    dr, durl = await serve(upstream(dseen, "decode"))
    xr, xurl = await serve(make_app(purl, durl))
    out: dict[str, Any] = {"prefill": pseen, "decode": dseen}
    try:
        async with aiohttp.ClientSession() as s:
            async with s.get(xurl + "/health") as r:
                out["health"] = r.status
            body = {"prompt": [5, 6, 7], "max_tokens": 9, "stream": True,
                    "stream_options": {"include_usage": True}, "temperature": 0.0}
            async with s.post(xurl + "/v1/completions", json=body) as r:
                out["status"], out["text"] = r.status, await r.text()
            async with s.post(xurl + "/v1/completions", data=b"{not json") as r:
                out["bad_json"] = r.status
            await dr.cleanup()
            async with s.get(xurl + "/health") as r:
                out["health_decode_down"] = r.status
    finally:
        for runner in (xr, pr, dr):
            await runner.cleanup()
    return out


def test_proxy_prefills_one_token_then_streams_decode_with_the_kv_params() -> None:
    out = asyncio.run(scenario(with_params=True))
    assert out["health"] == 200 and out["status"] == 200
    (p,) = out["prefill"]
    assert p["max_tokens"] == 1 and p["stream"] is False and "stream_options" not in p
    assert p["kv_transfer_params"] == {"do_remote_decode": True} and p["prompt"] == [5, 6, 7]
    (d,) = out["decode"]
    assert d["kv_transfer_params"] == PARAMS and d["max_tokens"] == 9 and d["stream"] is True
    assert d["stream_options"] == {"include_usage": True}
    assert '"text": "a"' in out["text"] and "[DONE]" in out["text"]
    assert out["bad_json"] == 400 and out["health_decode_down"] == 503


def test_proxy_refuses_when_prefill_returns_no_kv_params() -> None:
    out = asyncio.run(scenario(with_params=False))
    assert out["status"] == 502 and "kv_transfer_params" in out["text"]
    assert out["decode"] == []  # nothing reached decode
