"""P's bootstrap HTTP server and D's client for it.

Lifecycle (server, one per prefill instance, run by P rank 0 in a daemon thread):
1. `start()` binds `--host`:`--disaggregation-bootstrap-port` (fails fast if taken);
2. every P rank `PUT /route`s its control address, TP rank/size, page size, KV dtype, proving
   with header X-PD-Route-Secret that it is one of this instance's ranks (rank 0 draws the secret
   at start and broadcasts it over the TP group; no user setting); a PUT without it is answered
   403, so nobody else can redirect D's registration; the first registration fixes the
   instance-wide values, a conflicting one is answered 400;
3. D `GET /route?prefill_dp_rank=-1&target_tp_rank=-1` -> instance info (503 until every rank
   registered), `GET /route?prefill_dp_rank=D&target_tp_rank=T` -> {rank_ip, rank_port};
4. D's heartbeat `GET /health` -> 200 "OK"; every answer carries header X-PD-Instance (a new id
   after a restart), and D uses a route only when every answer of one resolution carried the
   same id; a decode server that refused a route naming this server `POST /refused`s the room
   (pdcore/route_refusal.py: MACed with a cluster secret) and the KV manager fails it unless a
   decode server claimed it;
5. connections are bounded (`netguard.ConnectionGate`): one request per connection, which must
   arrive and be answered within PENDING_DEADLINE_S of the accept, however it trickles (a 408
   and the close after it, counted in `timed_out`; D's heartbeat and the ranks take
   milliseconds); at most MAX_PENDING_PER_SOURCE connections per peer (`netguard.peer_key`) and
   MAX_PENDING in all, a new one evicting the same peer's (else anyone's) oldest (`evicted`), so
   a flood only pushes out its own connections and never starves the heartbeat and the ranks;
   P's `/metrics` count both (`pdserve_scheduler_kv_bootstrap_connections_*_total`);
6. `close()` stops the thread and frees the port.
"""

from __future__ import annotations

import dataclasses
import hmac
import http.client
import json
import logging
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from pdcore.errors import TransferError
from pdcore.messages.bootstrap import BootstrapInfo, RankRoute
from pdcore.netguard import PENDING_DEADLINE_S, ConnectionGate, is_loopback
from pdcore.route_refusal import MAC_HEADER, REFUSED_PATH, parse_notice

log = logging.getLogger(__name__)

INSTANCE_HEADER = "X-PD-Instance"
SECRET_HEADER = "X-PD-Route-Secret"
MAX_BODY = 1 << 16  # a rank's registration is a few hundred bytes
MAX_NOTICE = 4096  # a refusal notice: a room and D's reason
_408_BODY = json.dumps({"error": f"the request did not arrive within {PENDING_DEADLINE_S:g} s "
                                  "of the connection"}).encode()
TIMEOUT_408 = (b"HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\n"
               b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(_408_BODY)) + _408_BODY
_REQUIRED = ("rank_ip", "rank_port", "tp_rank", "tp_size", "page_size", "kv_cache_dtype")


class _Table:
    """Registered ranks of one prefill instance."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.instance_id = uuid.uuid4().hex
        self.info: BootstrapInfo | None = None
        self.ranks: dict[tuple[int, int], RankRoute] = {}

    def put(self, body: dict[str, Any]) -> str | None:
        """Register one rank; an error message (-> 400) or None."""
        missing = [k for k in _REQUIRED if k not in body]
        if missing:
            return f"PUT /route is missing {', '.join(missing)}"
        try:
            route = RankRoute.from_json(body)
            info = dataclasses.replace(BootstrapInfo.from_json(body), instance_id="")
        except ValueError as e:
            return f"PUT /route: {e}"
        if not (0 <= route.tp_rank < info.tp_size and 0 <= route.dp_rank < info.dp_size):
            return "tp_rank/dp_rank out of range"
        with self.lock:
            if self.info is None:
                self.info = info
            elif self.info != info:
                diff = self.info.differs(info)
                return f"rank {route.tp_rank} disagrees with the instance on {', '.join(diff)}"
            self.ranks[(route.dp_rank, route.tp_rank)] = route
        return None

    def complete(self) -> bool:
        with self.lock:
            return self.info is not None and len(self.ranks) >= (
                self.info.tp_size * self.info.dp_size)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"
    timeout = PENDING_DEADLINE_S  # a silent or slow client cannot hold a thread

    def handle_one_request(self) -> None:
        super().handle_one_request()
        self.close_connection = True  # one request per connection: its deadline is the whole
        self.server.gate.discard(self.request)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("bootstrap %s: " + format, self.client_address[0], *args)

    def _reply(self, code: int, body: Any, ctype: str = "application/json") -> None:
        data = (json.dumps(body) if ctype == "application/json" else str(body)).encode()
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.send_header(INSTANCE_HEADER, self.server.table.instance_id)
        self.send_header("Connection", "close")  # one request per connection (see 5.)
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        if url.path == "/health":
            return self._reply(200, "OK", "text/plain")
        if url.path != "/route":
            return self._reply(404, {"error": f"no route {url.path}"})
        q = {k: v[-1] for k, v in parse_qs(url.query).items()}
        missing = [k for k in ("prefill_dp_rank", "target_tp_rank") if k not in q]
        if missing:
            return self._reply(400, {"error": f"GET /route needs {', '.join(missing)}"})
        try:
            dp, tp = int(q["prefill_dp_rank"]), int(q["target_tp_rank"])
        except ValueError:
            return self._reply(400, {"error": "prefill_dp_rank and target_tp_rank must be ints"})
        table = self.server.table
        if not table.complete():
            return self._reply(503, {"error": "prefill ranks are still registering; retry"})
        with table.lock:
            if dp == -1 and tp == -1 and table.info is not None:
                info = dataclasses.replace(table.info, instance_id=table.instance_id)
                # and the keys SGLang's decode servers read (one attention group, no context
                # or pipeline parallelism)
                return self._reply(200, {**info.as_json(), "attn_tp_size": info.tp_size,
                                         "attn_cp_size": 1, "pp_size": 1,
                                         "follow_bootstrap_room": True})
            entry = table.ranks.get((dp, tp))
        if entry is None:
            return self._reply(404, {"error": f"no prefill rank dp={dp} tp={tp}"})
        return self._reply(200, {"rank_ip": entry.rank_ip, "rank_port": entry.rank_port})

    def do_POST(self) -> None:
        """A decode server's notice that it refused a route naming this server's room."""
        on_refused = self.server.on_refused
        if urlsplit(self.path).path != REFUSED_PATH or on_refused is None:
            return self._reply(404, {"error": "no such route"})
        try:
            n = int(self.headers.get("Content-Length", "0"))
            if not 0 < n <= MAX_NOTICE:
                raise ValueError(f"Content-Length {n} is outside [1, {MAX_NOTICE}]")
            room, reason = parse_notice(self.rfile.read(n), self.headers.get(MAC_HEADER, ""),
                                        self.server.token)
        except PermissionError as e:
            return self._reply(401, {"error": str(e)})
        except ValueError as e:  # json.JSONDecodeError too
            return self._reply(400, {"error": f"bad refusal notice: {e}"})
        return self._reply(200, {"room_failed": on_refused(room, reason)})

    def do_PUT(self) -> None:
        if urlsplit(self.path).path != "/route":
            return self._reply(404, {"error": "no such route"})
        secret = self.headers.get(SECRET_HEADER, "")
        if not hmac.compare_digest(secret.encode(), self.server.secret.encode()):
            log.warning("bootstrap: refused PUT /route from %s: it is not one of this prefill "
                        "instance's ranks (missing or wrong %s)", self.client_address[0],
                        SECRET_HEADER)
            self.close_connection = True
            return self._reply(403, {"error": "only this prefill instance's own ranks may "
                                              "register routes"})
        token = self.server.token
        if token:
            got = self.headers.get("Authorization", "")
            if not hmac.compare_digest(got.encode(), f"Bearer {token}".encode()):
                log.warning("bootstrap: rejected PUT /route from %s: wrong auth token",
                            self.client_address[0])
                return self._reply(401, {"error": "wrong or missing auth token"})
        try:
            n = int(self.headers.get("Content-Length", "0"))
            if not 0 <= n <= MAX_BODY:
                raise ValueError(f"Content-Length {n} is outside [0, {MAX_BODY}]")
            body = json.loads(self.rfile.read(n) or b"{}")
        except ValueError as e:
            return self._reply(400, {"error": f"bad JSON: {e}"})
        if not isinstance(body, dict):
            return self._reply(400, {"error": "the body must be a JSON object"})
        err = self.server.table.put(body)
        if err:
            return self._reply(400, {"error": err})
        return self._reply(200, "OK", "text/plain")


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128
    table: _Table
    token: str | None
    secret: str
    gate: ConnectionGate
    on_refused: Callable[[int, str], bool] | None

    def process_request(self, request: socket.socket,  # type: ignore[override]
                        client_address: tuple) -> None:
        self.gate.admit(request, str(client_address[0]))
        super().process_request(request, client_address)

    def service_actions(self) -> None:
        """Every poll interval (0.2 s): close the connections past their whole deadline."""
        self.gate.sweep(PENDING_DEADLINE_S, TIMEOUT_408)

    def shutdown_request(self, request: socket.socket) -> None:  # type: ignore[override]
        self.gate.discard(request)
        super().shutdown_request(request)

    def handle_error(self, request: object, client_address: tuple) -> None:
        # a client that hangs up (or an evicted flood connection) is routine, not a traceback
        log.debug("bootstrap: connection from %s ended with %r", client_address[0],
                  sys.exc_info()[1])


class BootstrapServer:
    def __init__(self, host: str, port: int, auth_token: str | None = None,
                 route_secret: str = "",
                 on_refused: Callable[[int, str], bool] | None = None) -> None:
        """`on_refused(room, reason)`: a decode server refused the route of `room` (True: the
        room failed; None: POST /refused is answered 404)."""
        if not route_secret:
            raise ValueError("BootstrapServer needs the instance's route secret")
        self.host, self._port, self.token = host, port, auth_token
        self.route_secret = route_secret
        self.on_refused = on_refused
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        try:
            srv = _Server((self.host, self._port), _Handler)
        except OSError as e:
            raise TransferError(
                f"cannot bind the bootstrap server on {self.host}:{self._port} ({e}); pick a "
                f"free --disaggregation-bootstrap-port") from None
        srv.table, srv.token, srv.secret = _Table(), self.token, self.route_secret
        srv.on_refused = self.on_refused
        srv.gate = ConnectionGate(f"bootstrap {self.host}:{srv.server_address[1]}")
        self._server = srv
        self._thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="pd-bootstrap", daemon=True)
        self._thread.start()
        log.info("bootstrap server on %s:%d (instance %s)", self.host, self.port,
                 srv.table.instance_id)
        if not self.token and not is_loopback(self.host):
            log.warning("bootstrap server binds %s without --disaggregation-auth-token: the PD "
                        "control plane is open to the network (routes are protected by the "
                        "instance secret, control messages are not); set the same token on "
                        "prefill and decode", self.host)

    @property
    def port(self) -> int:
        return self._server.server_address[1] if self._server else self._port

    def connection_stats(self) -> dict[str, int]:
        """Connections closed past their deadline or evicted by a newer one (P's /metrics)."""
        gate = self._server.gate if self._server else None
        return {"bootstrap_connections_timed_out": gate.timed_out if gate else 0,
                "bootstrap_connections_evicted": gate.evicted if gate else 0}

    @property
    def instance_id(self) -> str:
        return self._server.table.instance_id if self._server else ""

    def close(self) -> None:
        srv, self._server = self._server, None
        if srv is not None:
            srv.shutdown()
            srv.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)


class BootstrapClient:
    """Blocking HTTP calls to a bootstrap server, with timeouts on every call."""

    def __init__(self, connect_timeout: float = 2.0, read_timeout: float = 3.0,
                 token: str | None = None, route_secret: str = "") -> None:
        self.connect_timeout, self.read_timeout, self.token = connect_timeout, read_timeout, token
        self.route_secret = route_secret  # only P's ranks hold it (PUT /route)

    def _call(self, addr: str, method: str, path: str,
              body: dict | None = None) -> tuple[int, bytes, str]:
        host, _, port = addr.rpartition(":")
        conn = http.client.HTTPConnection(host.strip("[]"), int(port),
                                          timeout=self.connect_timeout)
        try:
            conn.connect()
            conn.sock.settimeout(self.read_timeout)
            headers = {"Connection": "close"}
            data = None
            if body is not None:
                data = json.dumps(body).encode()
                headers["Content-Type"] = "application/json"
                if self.token:
                    headers["Authorization"] = f"Bearer {self.token}"
                if self.route_secret:
                    headers[SECRET_HEADER] = self.route_secret
            conn.request(method, path, body=data, headers=headers)
            resp = conn.getresponse()
            return resp.status, resp.read(), resp.getheader(INSTANCE_HEADER, "")
        finally:
            conn.close()

    def _retrying(self, addr: str, method: str, path: str, body: dict | None, attempts: int,
                  interval: float, *, deadline: float | None = None) -> tuple[bytes, str]:
        last = ""
        for i in range(max(1, attempts)):
            try:
                status, data, inst = self._call(addr, method, path, body)
                if status == 200:
                    return data, inst
                last = f"HTTP {status}: {data[:200].decode(errors='replace')}"
                if status != 503:  # only "not ready yet" is worth retrying
                    break
            except (OSError, http.client.HTTPException) as e:
                last = f"{type(e).__name__}: {e}"
            if i + 1 < attempts and (deadline is None or time.monotonic() + interval < deadline):
                time.sleep(interval)
            else:
                break
        raise TransferError(f"bootstrap server {addr} {method} {path} failed: {last}")

    def get_info(self, addr: str, attempts: int = 1, interval: float = 1.0,
                 deadline: float | None = None) -> BootstrapInfo:
        """The prefill instance's facts, typed; TransferError when the answer is no such
        thing (a field of the wrong type, another instance's id)."""
        data, inst = self._retrying(addr, "GET", "/route?prefill_dp_rank=-1&target_tp_rank=-1",
                                    None, attempts, interval, deadline=deadline)
        try:
            info = BootstrapInfo.from_json(json.loads(data))
        except ValueError as e:  # json.JSONDecodeError too
            raise TransferError(f"bootstrap server {addr} answered malformed instance info: "
                                f"{e}") from None
        if info.instance_id != inst:
            raise TransferError(f"bootstrap server {addr} answered instance info that does not "
                                f"match its own {INSTANCE_HEADER} header; refusing it")
        return info

    def get_rank(self, addr: str, dp_rank: int, tp_rank: int, attempts: int = 1,
                 interval: float = 1.0, deadline: float | None = None,
                 *, instance: str = "") -> tuple[str, int]:
        """A rank's control address; with `instance`, only from that same P instance (a route
        answered by a restarted or different server is refused, never registered with)."""
        data, inst = self._retrying(
            addr, "GET", f"/route?prefill_dp_rank={dp_rank}&target_tp_rank={tp_rank}", None,
            attempts, interval, deadline=deadline)
        if instance and inst != instance:
            raise TransferError(f"bootstrap server {addr} changed instance ({instance} -> "
                                f"{inst or 'none'}) while decode resolved it; retrying later")
        d = json.loads(data)
        return str(d["rank_ip"]), int(d["rank_port"])

    def put_route(self, addr: str, payload: dict[str, Any], attempts: int = 5,
                  interval: float = 0.5) -> None:
        self._retrying(addr, "PUT", "/route", payload, attempts, interval)

    def health(self, addr: str) -> str:
        """The instance id; TransferError when P does not answer 200."""
        try:
            status, _, inst = self._call(addr, "GET", "/health")
        except (OSError, http.client.HTTPException) as e:
            raise TransferError(f"bootstrap {addr} /health: {type(e).__name__}: {e}") from None
        if status != 200:
            raise TransferError(f"bootstrap {addr} /health answered HTTP {status}")
        return inst
