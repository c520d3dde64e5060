"""Run one server in the foreground: `pdserve serve` and `python -m pdcore.launch_server`.

1. bind the listening socket first (a busy port fails before any model loads);
2. build the app; the lifespan spawns the scheduler and loads the model;
3. print the URL and an example once the engine is ready; on an engine start-up failure print
   why and exit 1; Ctrl-C stops uvicorn, whose shutdown stops the scheduler; the first
   SIGTERM of a ready server drains it (server/drain.py: 503 to new requests, exit 0 once the
   ones in flight are done or after --drain-timeout), a second one stops it at once;
4. when the scheduler dies after start-up the in-flight requests have failed already (503);
   the server then exits 1: uvicorn's graceful shutdown gets ENGINE_DEATH_DRAIN_S, and the
   process ends by ENGINE_DEATH_EXIT_S whatever still runs (the scheduler's own children die
   with it: PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
import threading
from typing import Any

from pdcore.config import ServerArgs
from pdcore.errors import ConfigError

log = logging.getLogger("pdcore.server")

ENGINE_DEATH_DRAIN_S, ENGINE_DEATH_EXIT_S = 1.0, 6.0


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror}; "
                          "pick another --port or --host") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def url_of(host: str, port: int, scheme: str = "http") -> str:
    shown = "127.0.0.1" if host in ("0.0.0.0", "") else host
    return f"{scheme}://[{shown}]:{port}" if ":" in shown else f"{scheme}://{shown}:{port}"


def try_line(url: str, mode: str) -> str:
    """What to try first: a chat request on a unified server; on a prefill or decode server,
    which answers generate requests only with a route from a router (400 without one), the
    router that pairs it."""
    if mode in ("prefill", "decode"):
        return (f"a {mode} server answers requests through a router: pdserve router "
                "--pd-disaggregation --prefill PREFILL_URL BOOTSTRAP_PORT --decode DECODE_URL "
                f"(this one: {url}; curl {url}/health)")
    return (f"try: curl {url}/v1/chat/completions -H 'Content-Type: application/json' "
            "-d '{\"messages\": [{\"role\": \"user\", \"content\": \"Hello\"}], "
            "\"max_tokens\": 32}'")


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _force_exit(server: Any) -> None:
    server.force_exit = True


def _exit_now(_server: Any) -> None:
    logging.shutdown()
    sys.stderr.flush()
    os._exit(1)


def _draining_server(uvicorn: Any, app: Any) -> Any:
    """uvicorn.Server whose first SIGTERM on a ready engine drains instead of stopping."""

    class DrainingServer(uvicorn.Server):  # type: ignore[misc,name-defined]
        def handle_exit(self, sig: int, frame: Any) -> None:
            drain, engine = app.state.drain, app.state.engine
            if sig == signal.SIGTERM and engine.ready and not drain.draining \
                    and not self.should_exit:
                try:
                    loop = asyncio.get_running_loop()
                except RuntimeError:
                    loop = None
                if loop is not None:
                    loop.call_soon_threadsafe(drain.begin, engine, "SIGTERM")
                    return
            super().handle_exit(sig, frame)

    return DrainingServer


def run_server(args: ServerArgs, **app_kwargs: Any) -> int:
    """Serve until stopped; returns the process exit code."""
    if args.node_rank > 0:  # a further node of a multi-node TP server: ranks only, no HTTP
        from pdcore.runtime import run_node

        configure_logging(args.log_level)
        return run_node(args)
    import uvicorn

    from pdcore.edge import connections, ports
    from pdcore.server.app import create_app

    configure_logging(args.log_level)
    tls = ports.tls_settings(args.ssl_certfile, args.ssl_keyfile, "--ssl-certfile",
                                   "--ssl-keyfile")
    sock = bind_socket(args.host, args.port)
    url = url_of(args.host, args.port, "https" if tls else "http")
    app = create_app(args, **app_kwargs)
    # header / body deadlines, a connection limit that evicts the slowest first, quiet logs
    _, protocol = connections.install(app, app.state.metrics.registry)
    config = uvicorn.Config(app, log_level=args.log_level.lower(), access_log=False,
                            timeout_graceful_shutdown=5, lifespan="on", http=protocol,
                            timeout_keep_alive=connections.keepalive_s(), **tls)
    server = _draining_server(uvicorn, app)(config)
    outcome = {"rc": 0}

    def on_drained(clean: bool) -> None:
        server.should_exit = True
        if not clean:  # what is left is aborted: its streams end with an error event
            for delay, action in ((ENGINE_DEATH_DRAIN_S, _force_exit),):
                timer = threading.Timer(delay, action, (server,))
                timer.daemon = True
                timer.start()

    app.state.drain.on_drained = on_drained

    def on_ready(engine: Any) -> None:
        name = engine.info.served_model_name or engine.info.model_path
        print(f"pdserve ready at {url} (model {name}, mode {args.disaggregation_mode})\n"
              f"  {try_line(url, args.disaggregation_mode)}", flush=True)

    def on_start_failed(err: Exception) -> None:
        if server.should_exit:  # Ctrl-C or SIGTERM while loading: a stop, not a failure
            print("pdserve: stopped while the engine was starting", file=sys.stderr, flush=True)
        else:
            print(f"pdserve: engine failed to start: {err}", file=sys.stderr, flush=True)
        outcome["rc"] = 1
        server.should_exit = True

    def on_engine_dead(why: str) -> None:
        print(f"pdserve: {why}", file=sys.stderr, flush=True)
        outcome["rc"] = outcome["engine_dead"] = 1
        server.should_exit = True
        # the failed requests' answers are out within milliseconds; then the exit must not
        # wait on idle keep-alive connections (a router's) or on new requests arriving
        for delay, action in ((ENGINE_DEATH_DRAIN_S, _force_exit), (ENGINE_DEATH_EXIT_S,
                                                                    _exit_now)):
            timer = threading.Timer(delay, action, (server,))
            timer.daemon = True
            timer.start()

    app.state.on_ready = on_ready
    app.state.on_start_failed = on_start_failed
    app.state.engine.on_dead = on_engine_dead
    print(f"pdserve: listening on {url}; loading the model (/health is 503 until ready)",
          flush=True)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it stopped on: stopped, no trace
        outcome["rc"] = outcome["rc"] or 130
    finally:
        sock.close()
    if outcome.get("engine_dead"):
        _exit_now(server)  # nothing is left to tear down; interpreter teardown took seconds
    return outcome["rc"]
