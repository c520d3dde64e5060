"""Who may name a PD route (layer 0: stdlib only): signed routes and trusted prefill addresses.

A request to a prefill (P) or decode (D) server names the route of its KV cache:
`bootstrap_host`, `bootstrap_port` (P's bootstrap server) and `bootstrap_room`. D contacts that
address, registers its KV memory there and waits for KV from it, so the route decides where D's
pool addresses, data-plane endpoint and KV go: it is never the client's to choose. A server acts
on a route only when

1. it carries a valid, unexpired signature (`bootstrap_sig`), added by the router
   (`pdserve router`, `pdserve up`) just before it forwards the request:
   `v2.<expiry>.<decode id>.<hex HMAC-SHA256>` over `v2|room|host:port|expiry|decode id|body
   digest` with a key derived from the cluster secret (`--disaggregation-auth-token`). The
   decode id is the server id of the decode server the router chose (each pdserve server sends
   it in the `x-pdserve-server-id` header of every answer; the router reads it from its health
   probes); a decode server refuses a route signed for another one. The body digest
   (`body_digest`) is SHA-256 over the request body without its route fields, as canonical
   JSON: whatever determines the prompt (`text`/`input_ids`, `prompt`, `messages`, `tools`,
   chat template options, ...) and the rest of the request is covered, the same way for every
   route, with no tokenizer at the router. Prefill and decode get the same body and check the
   same MAC, so a route copied into another request or sent to another decode server is a
   403 at HTTP, before admission. A signature is good for one request per server (a replay is
   403). A `v1` signature (which named the route only) is refused: router and servers must run
   the same protocol; or
2. its `host:port` is a prefill bootstrap address the server has been told about: the
   `--disaggregation-trusted-prefill` flag, registrations through the admin route
   `POST /disaggregation/trusted_prefill` (the admin key only), and, on P, its own bootstrap
   port (P cannot know every name it is reached by, and the route does not steer P: P sends
   KV only to decode ranks that authenticated on its control plane); or
3. it names a loopback address (127.0.0.0/8, ::1, localhost) whose port is the bootstrap port
   of a live pdserve prefill server of the same user on this host: each P announces its
   bootstrap port in a directory only its user can write (`local_prefill_dir()`), so the seed
   page's one-host commands serve behind sglang-router with no flag, while a loopback port
   nobody announced (another local process's listener) and every other host stay refused.
   This holds by default only on a server without a cluster secret: with one, the router signs
   every route and an unsigned one is refused (a client that reaches D could name P's loopback
   port itself). `PDSERVE_DISAGGREGATION_TRUST_LOCAL_PREFILL=0` or `=1` decides either way.

Everything else is refused with 403 before the engine sees it, including SGLang's warm-up host
`2.2.2.2` (a decode room with that host takes no KV at all: a client naming it would decode over
pages another request left behind). The key that signs routes is derived from the secret and is
not the key that authenticates control-plane messages (`control_key`), so neither use can be
turned into the other.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from pdcore.env import ENV, Env

SIG_VERSION = "v2"
DEFAULT_TTL_S = 60.0  # how long the router's signature lives (its queueing and forwarding)
CLOCK_SKEW_S = 30.0  # what servers allow between their clock and the router's, either way
MAX_SPENT = 262_144  # used signatures a server remembers (oldest forgotten first)
MAX_TRUSTED = 4096  # registered prefill addresses kept (oldest registration dropped first)
WARMUP_HOST = "2.2.2.2"  # SGLang's fake bootstrap host: only a server's own warm-up uses it
UNTRUSTED = "neither signed nor a trusted prefill address"  # in the 403's message, for people
ROUTE_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_sig")
SERVER_ID_HEADER = "x-pdserve-server-id"  # every answer of a PD server names its server id
_DECODE_ID = re.compile(r"[A-Za-z0-9_-]{0,64}")


def _derive(secret: str, label: bytes) -> bytes:
    return hmac.new(secret.encode(), label, hashlib.sha256).digest()


def route_key(secret: str) -> bytes:
    return _derive(secret, b"pdserve route signature v2")


def control_key(secret: str) -> bytes:
    return _derive(secret, b"pdserve control plane v1")


def normalize_addr(host: str, port: int | None) -> str:
    """`host:port` as routes are compared: lower-case host, IPv6 without brackets. No DNS
    lookup: a name and its address are different entries (list P as the router names it). A
    port left to the server's default (None) signs as `host:default`."""
    return f"{str(host).strip('[]').lower()}:{'default' if port is None else int(port)}"


def body_digest(body: Mapping[str, Any]) -> str:
    """SHA-256 (hex) of a request body without its route fields (ROUTE_FIELDS), as canonical
    JSON (sorted keys, no spaces, ASCII): what the router signs and what each server recomputes
    from the body it received (a JSON round trip keeps every value as it was)."""
    rest = {k: v for k, v in body.items() if k not in ROUTE_FIELDS}
    text = json.dumps(rest, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


def raw_body_digest(raw: bytes) -> str:
    """`body_digest` of a request's raw JSON body; '' when it is not a JSON object."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        return ""
    return body_digest(body) if isinstance(body, dict) else ""


def _payload(room: int, host: str, port: int | None, expiry: int, decode_id: str,
             digest: str) -> bytes:
    return (f"{SIG_VERSION}|{int(room)}|{normalize_addr(host, port)}|{expiry}|{decode_id}|"
            f"{digest}").encode()


def sign_route(key: bytes, room: int, host: str, port: int | None, decode_id: str, digest: str,
               *, ttl_s: float = DEFAULT_TTL_S, now: float | None = None) -> str:
    """The signature of a route to prefill `host:port`, room `room`, for the decode server
    `decode_id` and the request whose `body_digest` is `digest`."""
    if not _DECODE_ID.fullmatch(decode_id):
        raise ValueError(f"decode server id {decode_id!r} is not [A-Za-z0-9_-], 64 at most")
    expiry = int((time.time() if now is None else now) + ttl_s)
    mac = hmac.new(key, _payload(room, host, port, expiry, decode_id, digest),
                   hashlib.sha256).hexdigest()
    return f"{SIG_VERSION}.{expiry}.{decode_id}.{mac}"


def check_signature(key: bytes, sig: str, room: int, host: str, port: int | None,
                    digest: str, *, decode_id: str | None = None, now: float | None = None,
                    max_ttl_s: float = DEFAULT_TTL_S, skew_s: float = CLOCK_SKEW_S) -> str:
    """'' when `sig` signs exactly this route and request (`digest`) and has not expired, else
    why not. `decode_id`: this server's id on a decode server (the signature must name it),
    None on a prefill server (it is not the target; the MAC still covers the target named). A
    server accepts what the router signs (`max_ttl_s` ahead) give or take `skew_s` of clock
    skew: no longer-lived signature, however it was made."""
    parts = sig.split(".") if isinstance(sig, str) and len(sig) <= 192 else []
    if parts and parts[0] == "v1":
        return ("bootstrap_sig is a v1 signature, which binds neither the decode server nor the "
                "request; this server accepts v2 only: run router and servers of the same "
                "pdserve version")
    if len(parts) != 4 or parts[0] != SIG_VERSION or not parts[1].isdigit() \
            or not _DECODE_ID.fullmatch(parts[2]):
        return "bootstrap_sig is malformed"
    expiry, target = int(parts[1]), parts[2]
    if decode_id is not None and not hmac.compare_digest(target, decode_id):
        return (f"bootstrap_sig signs this route for another decode server ({target or 'none'}; "
                f"this one is {decode_id}): a route is good on the decode server the router "
                "chose only")
    want = hmac.new(key, _payload(room, host, port, expiry, target, digest),
                    hashlib.sha256).hexdigest()
    if not hmac.compare_digest(want, parts[3]):
        return "bootstrap_sig does not sign this route and request (another room, host, port " \
               "or request body, or another cluster secret)"
    t = time.time() if now is None else now
    if expiry < t - skew_s:
        return f"bootstrap_sig expired {t - expiry:.0f}s ago"
    if expiry > t + max_ttl_s + skew_s:  # longer than the router signs: a leaked-key smell
        return (f"bootstrap_sig expires too far in the future (the router signs for "
                f"{max_ttl_s:g}s, {skew_s:g}s of clock skew allowed)")
    return ""


LOCAL_TRUST_ENV = Env.pdserve_disaggregation_trust_local_prefill.name


def local_prefill_dir() -> str:
    """Where the prefill servers of this user on this host announce their bootstrap ports:
    `$XDG_RUNTIME_DIR/pdserve-prefill`, else `~/.cache/pdserve/prefill-bootstrap` (mode 0700)."""
    runtime = ENV.xdg_runtime_dir
    base = runtime or os.path.join(os.path.expanduser("~"), ".cache", "pdserve")
    name = "pdserve-prefill" if runtime else "prefill-bootstrap"
    return os.path.join(base, name)


def _private_dir(path: str) -> bool:
    """The directory is ours and nobody else can write into it."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    return st.st_uid == os.getuid() and not st.st_mode & 0o022


def announce_local_prefill(port: int) -> str | None:
    """Announce this process's prefill bootstrap port (see the module doc); the file to
    withdraw at exit, or None when the directory cannot be made private (nothing announced)."""
    path = local_prefill_dir()
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        if not _private_dir(path):
            return None
        entry = os.path.join(path, str(int(port)))
        tmp = f"{entry}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(str(os.getpid()))
        os.replace(tmp, entry)
        return entry
    except OSError:
        return None


def withdraw_local_prefill(entry: str | None) -> None:
    """Remove an announcement this process made (not one a later server made since)."""
    if not entry:
        return
    try:
        with open(entry) as f:
            mine = f.read().strip() == str(os.getpid())
        if mine:
            os.unlink(entry)
    except OSError:
        pass


def is_loopback(host: str) -> bool:
    host = str(host).strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_local_prefill(port: int) -> bool:
    """A live prefill server of this user announced `port` as its bootstrap port."""
    path = local_prefill_dir()
    entry = os.path.join(path, str(int(port)))
    try:
        if not _private_dir(path) or os.stat(entry).st_uid != os.getuid():
            return False
        with open(entry) as f:
            pid = int(f.read().strip() or 0)
        if pid <= 0:
            return False
        os.kill(pid, 0)  # alive (a killed server's stale entry does not count)
        return True
    except (OSError, ValueError):
        return False


def parse_addrs(spec: Iterable[str] | str | None) -> list[str]:
    """`host:port` entries of a flag value or list (comma or space separated), normalised;
    ValueError names the bad entry."""
    if spec is None:
        return []
    items = spec.replace(",", " ").split() if isinstance(spec, str) else [
        x for s in spec for x in str(s).replace(",", " ").split()]
    out = []
    for item in items:
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{item!r} is not HOST:PORT (a prefill server's bootstrap address, "
                             "e.g. 10.0.0.5:8998)")
        out.append(normalize_addr(host, int(port)))
    return out


class RouteGuard:
    """The trust a server's HTTP edge applies to the routes of PD requests (see module doc)."""

    def __init__(self, secret: str | None = None, trusted: Iterable[str] | str | None = None,
                 own_port: int | None = None, local: bool | None = None,
                 decode_id: str | None = None) -> None:
        self.key = route_key(secret) if secret else None
        self.own_port = own_port
        self.decode_id = decode_id  # a decode server's own id: the one signatures must name
        # the live prefill servers of this user on this host (module doc, point 3)
        # with a cluster secret every route is signed by the router: an unsigned loopback
        # route is then trusted only when the operator says so (a client that reaches D could
        # otherwise name P's loopback port itself and skip the signature)
        if local is None:
            local = ENV.pdserve_disaggregation_trust_local_prefill
        self.local = self.key is None if local is None else local
        self._fixed = set(parse_addrs(trusted))
        self._registered: OrderedDict[str, None] = OrderedDict()
        self._spent: OrderedDict[str, float] = OrderedDict()  # used signature -> its expiry
        self._lock = threading.Lock()
        self.refused = 0
        # on_refused(host, port, room, why) for each unsigned route refused: a decode server
        # tells the prefill server it names (route_refusal.RefusalNotifier.notify)
        self.on_refused: Callable[[str, int, int | None, str], object] | None = None

    def _spend(self, sig: str) -> str:
        """A signature is good for one request on this server: '' the first time, why not
        after (a replay of a copied route). Remembered until it expires (plus the skew)."""
        now = time.time()
        with self._lock:
            while self._spent and (len(self._spent) >= MAX_SPENT
                                   or next(iter(self._spent.values())) < now - CLOCK_SKEW_S):
                self._spent.popitem(last=False)
            if sig in self._spent:
                return ("bootstrap_sig was used already: a signature is good for one request "
                        "(a replayed route)")
            self._spent[sig] = float(sig.split(".")[1])
        return ""

    def register(self, addrs: Iterable[str]) -> list[str]:
        new = parse_addrs(list(addrs))
        with self._lock:
            for a in new:
                self._registered[a] = None
                self._registered.move_to_end(a)
            while len(self._registered) > MAX_TRUSTED:
                self._registered.popitem(last=False)
        return new

    def unregister(self, addrs: Iterable[str]) -> list[str]:
        gone = parse_addrs(list(addrs))
        with self._lock:
            for a in gone:
                self._registered.pop(a, None)
        return gone

    def trusted(self) -> list[str]:
        with self._lock:
            return sorted(self._fixed | set(self._registered))

    def is_trusted(self, host: str, port: int) -> bool:
        if port == self.own_port:
            return True
        if self.local and is_loopback(host) and is_local_prefill(port):
            return True
        a = normalize_addr(host, port)
        with self._lock:
            return a in self._fixed or a in self._registered

    def bind(self, raw_body: bytes) -> RequestGuard:
        """This guard for one request whose raw JSON body is `raw_body` (a signature covers
        its `body_digest`, computed once, only when a signed route needs it)."""
        return RequestGuard(self, raw_body)

    def check(self, room: int | None, host: str | None, port: int | None, sig: str | None,
              default_port: int, digest: Callable[[], str] | str = "") -> str:
        """'' when the server may act on this route, else why not (the HTTP edge answers 403).
        `port` as the request gave it (None: the server's `default_port`; a signature signs
        what was sent). `digest`: the request's `body_digest` (or a function giving it). A
        request naming no bootstrap host names no route: the role decides what that means."""
        if host is None:
            return ""
        why = self._why(room, host, port, sig, default_port, digest)
        if why:
            with self._lock:
                self.refused += 1
            if self.on_refused is not None and not sig:
                self.on_refused(host, default_port if port is None else port, room, why)
        return why

    def _why(self, room: int | None, host: str, port: int | None, sig: str | None,
             default_port: int, digest: Callable[[], str] | str) -> str:
        if host.strip("[]") == WARMUP_HOST:
            return (f"bootstrap_host {WARMUP_HOST} is reserved for the server's own warm-up; a "
                    "client cannot name it")
        if room is None:
            return "a PD route needs bootstrap_room with bootstrap_host"
        if sig:
            if self.key is None:
                return ("bootstrap_sig given but this server has no cluster secret to check it; "
                        "start it with the router's --disaggregation-auth-token")
            return check_signature(self.key, sig, room, host, port,
                                   digest if isinstance(digest, str) else digest(),
                                   decode_id=self.decode_id) or self._spend(sig)
        port = default_port if port is None else port
        if self.is_trusted(host, port):
            return ""
        how = ("the router signs routes with the cluster secret: give router and servers the "
               "same --disaggregation-auth-token" if self.key else
               "start this server with --disaggregation-trusted-prefill HOST:PORT (the prefill "
               "server's bootstrap address), or give router and servers the same "
               "--disaggregation-auth-token so the router signs its routes")
        return (f"the route to prefill {normalize_addr(host, port)} is {UNTRUSTED} of this "
                f"server; {how}")


class RequestGuard:
    """A RouteGuard bound to one request's raw body (RouteGuard.bind)."""

    def __init__(self, guard: RouteGuard, raw_body: bytes) -> None:
        self.guard = guard
        self._raw = raw_body
        self._digest: str | None = None

    def digest(self) -> str:
        if self._digest is None:
            self._digest = raw_body_digest(self._raw)
        return self._digest

    def check(self, room: int | None, host: str | None, port: int | None, sig: str | None,
              default_port: int) -> str:
        return self.guard.check(room, host, port, sig, default_port, self.digest)
