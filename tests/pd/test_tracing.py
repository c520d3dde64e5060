"""OpenTelemetry across one PD request (#45 item 12, `--enable-trace`): a real 1P1D cluster
behind our router (tiny model, tcp, loopback), every process exporting to an OTLP/HTTP receiver
run by this test (protobuf, parsed with opentelemetry-proto). One request gives a router span,
a prefill span, a decode span and a kv_transfer span, all in one trace: the router's is the
root (under the client's own traceparent when it sends one), P's and D's are its children, the
transfer is decode's child."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdcore.testing.processes import PDCluster

pytest.importorskip("opentelemetry.sdk", reason="the `trace` extra")
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2  # noqa: E402

pytestmark = pytest.mark.timeout(400)
FLAGS = ("--max-total-tokens", "2048", "--page-size", "4", "--skip-server-warmup")
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_PARENT = "00f067aa0ba902b7"


class Receiver:
    """A minimal OTLP/HTTP trace collector on 127.0.0.1: POST /v1/traces, protobuf."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        lock = threading.Lock()
        spans = self.spans

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                req = trace_service_pb2.ExportTraceServiceRequest()
                req.ParseFromString(body)
                with lock:
                    for rs in req.resource_spans:
                        service = next((a.value.string_value for a in rs.resource.attributes
                                        if a.key == "service.name"), "")
                        for ss in rs.scope_spans:
                            for s in ss.spans:
                                spans.append({
                                    "service": service, "name": s.name,
                                    "trace": s.trace_id.hex(), "id": s.span_id.hex(),
                                    "parent": s.parent_span_id.hex(),
                                    "start": s.start_time_unix_nano,
                                    "end": s.end_time_unix_nano,
                                    "attrs": {a.key: a.value for a in s.attributes}})
                out = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def wait(self, trace: str, names: set[str], timeout: float = 30.0) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while True:
            got = [s for s in list(self.spans) if s["trace"] == trace]
            if names <= {s["name"] for s in got} or time.monotonic() > deadline:
                return got
            time.sleep(0.1)


def test_one_trace_across_router_prefill_transfer_and_decode(tiny_llama_dir: Path) -> None:
    receiver = Receiver()
    trace = ("--enable-trace", "--otlp-traces-endpoint", f"127.0.0.1:{receiver.port}")
    cluster = PDCluster("tcp", model_path=str(tiny_llama_dir), flags=(*FLAGS, *trace),
                        router_flags=trace).start(300)
    try:
        r = httpx.post(cluster.url + "/generate", timeout=120, json={
            "text": "Tell me a story", "sampling_params": {"max_new_tokens": 6,
                                                           "ignore_eos": True}},
            headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_PARENT}-01"})
        assert r.status_code == 200, r.text
        want = {"router", "prefill", "decode", "kv_transfer"}
        spans = receiver.wait(CLIENT_TRACE, want)
        by_name = {s["name"]: s for s in spans}
        assert want <= set(by_name), (sorted(by_name), receiver.spans[:5])
        router, p, d, kv = (by_name[n] for n in ("router", "prefill", "decode", "kv_transfer"))
        assert router["parent"] == CLIENT_PARENT  # the client's traceparent is honoured
        assert (router["service"], p["service"], d["service"]) == (
            "pdserve-router", "pdserve-prefill", "pdserve-decode")
        assert p["parent"] == router["id"] and d["parent"] == router["id"]
        assert kv["parent"] == d["id"] and kv["service"] == "pdserve-decode"
        room = p["attrs"]["pdserve.bootstrap_room"].int_value
        assert room == d["attrs"]["pdserve.bootstrap_room"].int_value  # the same room
        assert d["start"] <= kv["start"] <= kv["end"] <= d["end"]
        # a request without a traceparent starts its own trace at the router
        r = httpx.post(cluster.url + "/generate", timeout=120, json={
            "text": "Hi", "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 200, r.text
        deadline = time.monotonic() + 30
        while True:
            roots = [s for s in receiver.spans if s["name"] == "router"
                     and s["trace"] != CLIENT_TRACE]
            if roots or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert roots and roots[0]["parent"] == ""
        others = receiver.wait(roots[0]["trace"], {"prefill", "decode"})
        assert {"prefill", "decode"} <= {s["name"] for s in others}
    finally:
        cluster.stop()
        receiver.server.shutdown()
