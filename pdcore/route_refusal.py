"""A decode server that refuses a route tells the prefill server the route names, when that
server runs on this host (layer 1; issue 45 item 6).

A router sends each request to P and D at once. When D refuses the request's route (403:
neither signed nor a trusted prefill address, route_auth.py), P has the request too and would
hold its room until the claim timeout, and sglang-router waits for P's answer and then retries
the pair 5 times: 26 s at the default 5 s claim timeout before the client heard anything. So D
tells P at once: one `POST /refused` to the bootstrap address the route names, with the room
and D's reason; P fails that room if no decode server claimed it (a claimed room is bound to
its decode server and goes on), and answers its request with 403 and the reason.

The route's address is not trusted (that is why it was refused), so the notice is bounded:
- it goes only to the bootstrap port of a live prefill server of this user on this host (the
  port it announced, route_auth.is_local_prefill) and only at an address of this host (a
  loopback address, or an IP literal this host can bind): nothing leaves the host and no other
  listener is ever contacted. A prefill server on another host is not told: its room ends at
  the claim timeout (give decode `--disaggregation-trusted-prefill`, or sign routes);
- it carries the room (the route's own, chosen by the request's sender) and D's reason (text
  about the route) and nothing of D's: no control address, session, KV address or token; of
  P's answer D reads one packet's first 64 bytes and nothing acts on them;
- with a cluster secret it carries an HMAC of the body under a key derived from the secret
  (`refusal_key`, a key of its own), and P acts only on notices whose MAC is right;
- it is sent only for an unsigned route (`pdserve router` signs its routes, and cancels P's
  leg itself when D refuses one);
- one daemon thread sends them, with a 1 s connect and read timeout, from a queue of 64
  (a full queue drops the notice), at most 20 a second, one per (address, room).
  `pdserve_route_refusal_notices_total{result}` counts them on D;
  `PDSERVE_DISAGGREGATION_NOTIFY_REFUSED=0` turns them off (P then learns from the claim
  timeout).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import logging
import queue
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from pdcore.env import ENV
from pdcore.route_auth import is_local_prefill, is_loopback

log = logging.getLogger(__name__)

REFUSED_PATH = "/refused"
MAC_HEADER = "X-PD-Refusal-MAC"
# the failure code of a room whose route decode refused: P's record and its answer's reason
# (the same value as pdcore.messages.codes.ErrorCode.ROUTE_REFUSED, the 403's code on D)
ROUTE_REFUSED = "route_refused"
# how P's answer for such a room begins (a router waits for decode's own answer then)
DECODE_REFUSED = f"decode refused this request's route ({ROUTE_REFUSED})"
MAX_BODY = 4096  # a notice is a room and a reason of at most MAX_REASON characters
MAX_REASON = 1024


def refusal_key(secret: str) -> bytes:
    """The MAC key of refusal notices: derived from the cluster secret, neither the route
    signature key nor the control-plane key."""
    return hmac.new(secret.encode(), b"pdserve route refusal v1", hashlib.sha256).digest()


def notice_body(room: int, reason: str) -> bytes:
    return json.dumps({"room": int(room), "reason": reason[:MAX_REASON]}).encode()


def notice_mac(key: bytes, body: bytes) -> str:
    return hmac.new(key, body, hashlib.sha256).hexdigest()


def parse_notice(body: bytes, mac: str, secret: str | None) -> tuple[int, str]:
    """(room, reason) of a notice P received; ValueError says why it is not one (P answers
    400, or 401 for a wrong or missing MAC when P has a cluster secret)."""
    if secret and not hmac.compare_digest(mac.encode(), notice_mac(refusal_key(secret),
                                                                   body).encode()):
        raise PermissionError("refusal notice without the cluster secret's MAC")
    doc = json.loads(body)
    if not isinstance(doc, dict) or type(doc.get("room")) is not int \
            or not 0 <= doc["room"] < 2**64 or not isinstance(doc.get("reason", ""), str):
        raise ValueError('a refusal notice is {"room": int in [0, 2^64), "reason": str}')
    reason = "".join(c if c.isprintable() else " " for c in doc.get("reason", "")[:MAX_REASON])
    return doc["room"], reason


def this_host(host: str) -> bool:
    """`host` is an address of this machine: a loopback name or address, or an IP literal a
    socket here can bind (no lookup, no packet sent; other names are not this host)."""
    if is_loopback(host):
        return True
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        return False
    family = socket.AF_INET6 if addr.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.bind((str(addr), 0))
        return not addr.is_unspecified and not addr.is_multicast
    except OSError:
        return False


class RefusalNotifier:
    """D's side: `notify()` queues a notice and returns at once; a daemon thread sends it."""

    QUEUE = 64
    RATE = 20.0  # notices a second, on average (a burst of RATE at most)
    RECENT = 4096  # (address, room) pairs remembered so one route is told once

    def __init__(self, secret: str | None = None, *, timeout: float = 1.0,
                 count: Callable[[str], object] | None = None) -> None:
        """`count(result)` is called for every notice's result (sent, failed, dropped,
        skipped), from the caller's or the sending thread."""
        self.key = refusal_key(secret) if secret else None
        self._count_cb = count
        self.timeout = timeout
        self.counts = {"sent": 0, "failed": 0, "dropped": 0, "skipped": 0}
        self._q: queue.Queue[tuple[str, int, bytes] | None] = queue.Queue(self.QUEUE)
        self._recent: OrderedDict[tuple[str, int, int], None] = OrderedDict()
        self._lock = threading.Lock()
        self._tokens, self._last = self.RATE, time.monotonic()
        self._thread = threading.Thread(target=self._run, name="pd-refusal-notices",
                                        daemon=True)
        self._thread.start()

    @classmethod
    def from_env(cls, secret: str | None,
                 count: Callable[[str], object] | None = None) -> RefusalNotifier | None:
        """None when PDSERVE_DISAGGREGATION_NOTIFY_REFUSED=0."""
        if not ENV.pdserve_disaggregation_notify_refused:
            return None
        return cls(secret, count=count)

    def notify(self, host: str, port: int, room: int | None, reason: str) -> bool:
        """Queue the notice for an unsigned route D refused; False when it is not sent: no
        room, or not a live prefill server announced on this host (module doc)."""
        host = host.strip("[]")
        if room is None or not 0 < port < 65536 or not is_local_prefill(port) \
                or not this_host(host):
            self._count("skipped")
            return False
        with self._lock:
            key = (host.lower(), port, room)
            if key in self._recent:
                return False
            self._recent[key] = None
            while len(self._recent) > self.RECENT:
                self._recent.popitem(last=False)
        try:
            self._q.put_nowait((host, port, notice_body(room, reason)))
        except queue.Full:
            self._count("dropped")
            return False
        return True

    def _count(self, what: str) -> None:
        with self._lock:
            self.counts[what] += 1
        if self._count_cb is not None:
            self._count_cb(what)

    def _wait_token(self) -> None:
        while True:
            now = time.monotonic()
            self._tokens = min(self.RATE, self._tokens + (now - self._last) * self.RATE)
            self._last = now
            if self._tokens >= 1:
                self._tokens -= 1
                return
            time.sleep((1 - self._tokens) / self.RATE)

    def _run(self) -> None:
        while (item := self._q.get()) is not None:
            self._wait_token()
            host, port, body = item
            try:
                self._send(host, port, body)
                self._count("sent")
            except OSError as e:
                self._count("failed")
                log.debug("refusal notice to %s:%d not delivered: %s", host, port, e)

    def _send(self, host: str, port: int, body: bytes) -> None:
        """One request on its own connection; one read of P's first bytes, then close: a
        listener that never answers, or trickles, holds the thread for 2 timeouts at most."""
        name = f"[{host}]" if ":" in host else host
        head = (f"POST {REFUSED_PATH} HTTP/1.1\r\nHost: {name}:{port}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                "Connection: close\r\n")
        if self.key is not None:
            head += f"{MAC_HEADER}: {notice_mac(self.key, body)}\r\n"
        with socket.create_connection((host, port), timeout=self.timeout) as s:
            s.sendall(head.encode() + b"\r\n" + body)
            s.recv(64)  # P's status line: it read the notice (nothing else is read)

    def close(self) -> None:
        try:
            self._q.put_nowait(None)
        except queue.Full:
            pass
        self._thread.join(timeout=2 * self.timeout + 1)
