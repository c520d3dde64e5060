"""A Kubernetes API stand-in for the discovery tests: no API server can run on this machine.

It serves the two pod routes the router's client calls, as the API server does: `GET
/api/v1/namespaces/{ns}/pods` (and `/api/v1/pods`) with `labelSelector` returns a PodList; the
same with `watch=true&resourceVersion=N&timeoutSeconds=T` streams newline-delimited
`{"type", "object"}` events after N over a chunked response and ends it after T seconds. A watch
from a compacted resourceVersion (or one open when the test compacts) gets an ERROR event whose
object is the API's 410 `Status` (reason Expired). Objects are the recorded ones in
k8s_fixtures/ (the kubernetes client's own serialization); a test patches names, uids and ports.
Requests without the kubeconfig's bearer token get 401, as a real server answers.
"""

from __future__ import annotations

import copy
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

FIXTURES = Path(__file__).parent / "k8s_fixtures"
TOKEN = "standin-token-4f9a"


def fixture(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / name).read_text())


def _matches(labels: dict[str, str], selector: str) -> bool:
    for term in filter(None, selector.split(",")):
        key, _, value = term.partition("=")
        if labels.get(key) != value:
            return False
    return True


class KubeStandIn:
    def __init__(self) -> None:
        self.rv = 48230  # the recorded PodList's resourceVersion
        self.compacted_rv = 0
        self.pods: dict[str, dict[str, Any]] = {}
        self.events: list[tuple[int, str, dict[str, Any]]] = []
        self.cond = threading.Condition()
        self.requests: list[str] = []  # "list SELECTOR NS" / "watch SELECTOR NS RV" (NS * = all)
        self.closing = False
        self.conns: list[socket.socket] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def setup(self) -> None:
                super().setup()
                outer.conns.append(self.connection)

            def do_GET(self) -> None:  # http.server's name
                outer._handle(self)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def start(self) -> KubeStandIn:
        self._thread.start()
        return self

    def stop(self) -> None:
        with self.cond:
            self.closing = True
            self.cond.notify_all()
        self.server.shutdown()
        self.server.server_close()
        for conn in self.conns:  # kept-alive connections too: the server is gone
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def kubeconfig(self, path: Path) -> Path:
        cfg = {"apiVersion": "v1", "kind": "Config", "current-context": "standin",
               "clusters": [{"name": "standin", "cluster": {"server": self.url}}],
               "users": [{"name": "router", "user": {"token": TOKEN}}],
               "contexts": [{"name": "standin", "context": {
                   "cluster": "standin", "user": "router", "namespace": "pdserve"}}]}
        path.write_text(json.dumps(cfg))
        return path

    # ---- the cluster's side: what the kubelet and controllers would write ------------------
    def apply(self, pod: dict[str, Any]) -> None:
        """Create (ADDED) or update (MODIFIED) a pod, as the API records a write."""
        pod = copy.deepcopy(pod)
        name = pod["metadata"]["name"]
        with self.cond:
            self.rv += 1
            pod["metadata"]["resourceVersion"] = str(self.rv)
            kind = "MODIFIED" if name in self.pods else "ADDED"
            self.pods[name] = pod
            self.events.append((self.rv, kind, pod))
            self.cond.notify_all()

    def delete(self, name: str) -> None:
        with self.cond:
            pod = self.pods.pop(name)
            self.rv += 1
            pod = copy.deepcopy(pod)
            pod["metadata"]["resourceVersion"] = str(self.rv)
            self.events.append((self.rv, "DELETED", pod))
            self.cond.notify_all()

    def compact(self) -> None:
        """etcd compaction: every resourceVersion up to now is gone; open watches get 410."""
        with self.cond:
            self.rv += 1
            self.compacted_rv = self.rv
            self.cond.notify_all()

    def count(self, prefix: str) -> int:
        return sum(1 for r in self.requests if r.startswith(prefix))

    # ---- HTTP -------------------------------------------------------------------------------
    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        parts = urlsplit(h.path)
        q = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        path = parts.path.rstrip("/")
        segs = path.split("/")
        namespaced = len(segs) == 6 and segs[:4] == ["", "api", "v1", "namespaces"] \
            and segs[5] == "pods"
        if h.headers.get("Authorization") != f"Bearer {TOKEN}":
            self._json(h, 401, self._status(401, "Unauthorized", "Unauthorized"))
            return
        if not (namespaced or path == "/api/v1/pods"):
            self._json(h, 404, self._status(404, "NotFound", "the server could not find the "
                                            "requested resource"))
            return
        ns = segs[4] if namespaced else None
        selector = q.get("labelSelector", "")
        if q.get("watch") in ("true", "1", "True"):
            self._watch(h, ns, selector, int(q.get("resourceVersion") or 0),
                        float(q.get("timeoutSeconds") or 1800))
            return
        with self.cond:
            self.requests.append(f"list {selector} {ns or '*'}")
            items = []
            for pod in self.pods.values():
                if self._selects(pod, ns, selector):
                    item = copy.deepcopy(pod)
                    item.pop("kind", None), item.pop("apiVersion", None)  # as in a real list
                    items.append(item)
            body = fixture("pod_list_empty.json")
            body["metadata"]["resourceVersion"] = str(self.rv)
            body["items"] = items
        self._json(h, 200, body)

    @staticmethod
    def _selects(pod: dict[str, Any], ns: str | None, selector: str) -> bool:
        meta = pod["metadata"]
        return (ns is None or meta["namespace"] == ns) and _matches(meta.get("labels", {}),
                                                                  selector)

    def _watch(self, h: BaseHTTPRequestHandler, ns: str | None, selector: str, since: int,
               timeout: float) -> None:
        self.requests.append(f"watch {selector} {ns or '*'} {since}")
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()
        deadline = time.monotonic() + timeout
        sent = since
        try:
            while True:
                with self.cond:
                    if since < self.compacted_rv or sent < self.compacted_rv:
                        gone = fixture("status_gone.json")
                        gone["message"] = f"too old resource version: {sent} ({self.rv})"
                        self._chunk(h, {"type": "ERROR", "object": gone})
                        break
                    todo = [(rv, kind, pod) for rv, kind, pod in self.events if rv > sent]
                    left = deadline - time.monotonic()
                    if not todo:
                        if self.closing or left <= 0:
                            break
                        self.cond.wait(min(left, 0.5))
                        continue
                for rv, kind, pod in todo:
                    sent = rv
                    if self._selects(pod, ns, selector):
                        self._chunk(h, {"type": kind, "object": pod})
            h.wfile.write(b"0\r\n\r\n")
            h.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            pass

    @staticmethod
    def _chunk(h: BaseHTTPRequestHandler, event: dict[str, Any]) -> None:
        data = json.dumps(event).encode() + b"\n"
        h.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        h.wfile.flush()

    @staticmethod
    def _status(code: int, reason: str, message: str) -> dict[str, Any]:
        body = fixture("status_gone.json")
        body.update(code=code, reason=reason, message=message)
        return body

    @staticmethod
    def _json(h: BaseHTTPRequestHandler, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        h.send_response(code)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)
