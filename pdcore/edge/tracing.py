"""OpenTelemetry spans for one request across router, prefill and decode (`--enable-trace`,
`--otlp-traces-endpoint`; SGLang's and sglang-router's flags). One setup for servers and router.

- the router's span is the root (or the child of a client's `traceparent`); it sends W3C
  `traceparent` to P and D with the same body;
- a server's ASGI middleware makes the incoming `traceparent` the context of the whole request
  (its response streamed to the end), so every span the request makes is its child;
- per scheduler request (generation.py): a `prefill` or `decode` (or `generate`, unified) span
  from its submission to its end; on decode, a `kv_transfer` child from the submission to the
  first token, which comes with the KV and aux row P sent;
- spans leave in batches over OTLP/HTTP (protobuf) to HOST:PORT/v1/traces.

The SDK is the optional `trace` extra (`pip install 'pdcore[trace]'`), imported only when the
flag is on; without the flag every call here is a no-op.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from typing import Any

from pdcore.errors import ConfigError

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'pdcore[trace]' (opentelemetry-sdk and its OTLP/HTTP exporter)"
_state: dict[str, Any] = {}  # tracer, provider, propagator once set up


def endpoint_url(endpoint: str) -> str:
    """HOST:PORT -> http://HOST:PORT/v1/traces; a URL without a path gets /v1/traces."""
    url = endpoint if "://" in endpoint else f"http://{endpoint}"
    scheme, _, rest = url.partition("://")
    return url if "/" in rest.rstrip("/") else f"{scheme}://{rest.rstrip('/')}/v1/traces"


def check_available(flag: str = "--enable-trace") -> None:
    """ConfigError naming the extra when the SDK is missing."""
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError as e:
        raise ConfigError(f"{flag} needs the OpenTelemetry SDK ({e.name} is missing): "
                          f"{INSTALL_HINT}") from None


def setup(service: str, endpoint: str) -> None:
    """Export this process's spans as `service` to the OTLP/HTTP collector at `endpoint`."""
    check_available()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(BatchSpanProcessor(
        OTLPSpanExporter(endpoint=endpoint_url(endpoint), timeout=5),
        schedule_delay_millis=500))
    _state.update(tracer=provider.get_tracer("pdcore"), provider=provider,
                  propagator=TraceContextTextMapPropagator())
    log.info("OpenTelemetry: spans of %s go to %s", service, endpoint_url(endpoint))


def enabled() -> bool:
    return "tracer" in _state


def shutdown() -> None:
    """Flush what is queued and stop exporting."""
    provider = _state.pop("provider", None)
    _state.clear()
    if provider is not None:
        provider.shutdown()


@contextlib.contextmanager
def remote_parent(headers: Mapping[str, str]) -> Iterator[None]:
    """The incoming `traceparent` as the current context until the block ends."""
    if not enabled():
        yield
        return
    from opentelemetry import context

    token = context.attach(_state["propagator"].extract(carrier=dict(headers)))
    try:
        yield
    finally:
        context.detach(token)


@contextlib.contextmanager
def span(name: str, attrs: Mapping[str, Any] | None = None, server: bool = False
         ) -> Iterator[Any]:
    """A span, child of the current context; yields it (None when tracing is off)."""
    if not enabled():
        yield None
        return
    from opentelemetry.trace import SpanKind

    kind = SpanKind.SERVER if server else SpanKind.INTERNAL
    with _state["tracer"].start_as_current_span(name, kind=kind) as sp:
        for k, v in (attrs or {}).items():
            if v is not None:
                sp.set_attribute(k, v if isinstance(v, (str, bool, int, float)) else str(v))
        yield sp


def child(name: str, start_ns: int, end_ns: int, attrs: Mapping[str, Any] | None = None) -> None:
    """A finished child span of the current one over [start_ns, end_ns] (time.time_ns())."""
    if not enabled():
        return
    sp = _state["tracer"].start_span(name, start_time=start_ns)
    for k, v in (attrs or {}).items():
        if v is not None:
            sp.set_attribute(k, v)
    sp.end(end_time=end_ns)


def inject() -> dict[str, str]:
    """The current span's `traceparent` (and `tracestate`) for an outgoing call; {} when off."""
    if not enabled():
        return {}
    out: dict[str, str] = {}
    _state["propagator"].inject(out)
    return out


class TraceMiddleware:
    """ASGI: an HTTP request's `traceparent` is the context of everything it runs, its whole
    response included (a stream's last chunk too)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope.get("type") != "http" or not enabled():
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", [])}
        with remote_parent(headers):
            await self.app(scope, receive, send)
