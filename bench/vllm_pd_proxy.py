"""A minimal prefill/decode proxy for two vLLM servers joined by a KV connector (NixlConnector),
so bench/vs_vllm.py can measure vLLM 1P1D with the same client as every other system.

vLLM ships no proxy in its wheel; its disaggregation protocol (the one its own test proxy uses):
1. the prefill server gets the request with max_tokens 1, no streaming, and
   kv_transfer_params {"do_remote_decode": true}: it computes the prompt's KV, keeps it for a
   remote reader, and answers with kv_transfer_params naming its engine, blocks and side channel;
2. the decode server gets the original request plus those kv_transfer_params: it pulls the KV
   over the connector and generates; its answer (streamed or not) goes back to the client as is.

Only /v1/completions is proxied (the benchmark's endpoint); /health answers 200 when both
upstreams do. Run: `python bench/vllm_pd_proxy.py --port P --prefill URL --decode URL`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
from typing import Any

import aiohttp
from aiohttp import web

log = logging.getLogger("vllm_pd_proxy")
UPSTREAM_TIMEOUT_S = 600.0
HEALTH_TIMEOUT_S = 5.0
PREFILL = web.AppKey("prefill", str)
DECODE = web.AppKey("decode", str)
SESSION = web.AppKey("session", aiohttp.ClientSession)


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request as the prefill server must see it: one token, no stream, remote decode."""
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    out.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


def decode_body(body: dict[str, Any], prefill_answer: dict[str, Any]) -> dict[str, Any] | None:
    """The client's request plus the prefill server's kv_transfer_params (the KV's address);
    None when the answer has none (a prefill server started without a KV connector)."""
    params = prefill_answer.get("kv_transfer_params")
    return {**body, "kv_transfer_params": params} if isinstance(params, dict) else None


def error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status}}, status=status)


async def completions(request: web.Request) -> web.StreamResponse:
    app = request.app
    try:
        body = await request.json()
    except json.JSONDecodeError as e:
        return error(400, f"body is not JSON: {e}")
    if not isinstance(body, dict):
        return error(400, "body must be a JSON object")
    session = app[SESSION]
    async with session.post(app[PREFILL] + "/v1/completions", json=prefill_body(body)) as r:
        if r.status != 200:
            return error(r.status, f"prefill server: {(await r.text())[:500]}")
        answer = await r.json()
    dbody = decode_body(body, answer)
    if dbody is None:
        return error(502, "prefill answer carries no kv_transfer_params (is the prefill server "
                          "started with --kv-transfer-config?)")
    async with session.post(app[DECODE] + "/v1/completions", json=dbody) as r:
        if r.status != 200 or not body.get("stream"):
            return web.Response(status=r.status, body=await r.read(),
                                content_type=r.content_type)
        out = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        async for chunk in r.content.iter_any():
            await out.write(chunk)
        await out.write_eof()
        return out


async def health(request: web.Request) -> web.Response:
    session = request.app[SESSION]
    for name, key in (("prefill", PREFILL), ("decode", DECODE)):
        try:
            async with session.get(request.app[key] + "/health",
                                   timeout=aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)) as r:
                if r.status != 200:
                    return error(503, f"{name} server /health answered {r.status}")
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return error(503, f"{name} server unreachable: {type(e).__name__}")
    return web.json_response({"status": "ok"})


def make_app(prefill: str, decode: str) -> web.Application:
    app = web.Application()
    app[PREFILL], app[DECODE] = prefill.rstrip("/"), decode.rstrip("/")

    async def session_ctx(app: web.Application) -> Any:
        app[SESSION] = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=UPSTREAM_TIMEOUT_S),
            connector=aiohttp.TCPConnector(limit=0))
        yield
        await app[SESSION].close()

    app.cleanup_ctx.append(session_ctx)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", health)
    return app


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--prefill", required=True, help="prefill server URL")
    ap.add_argument("--decode", required=True, help="decode server URL")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    web.run_app(make_app(args.prefill, args.decode), host=args.host, port=args.port,
                print=None, access_log=None)


if __name__ == "__main__":
    main()
