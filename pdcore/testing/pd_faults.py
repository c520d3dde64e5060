"""Fault-injection scenarios for a PD deployment, reusable by every backend's tests.

Each scenario starts real processes on loopback (tiny model, short timeouts) and asserts that
no request hangs past its timeout, the survivors stay healthy, every KV page comes back, and a
restarted server is picked up without restarting the other side.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import httpx

from pdcore.testing.pages import load_at_rest
from pdcore.testing.processes import PDCluster, spawned_children

HEARTBEAT_S, MAX_FAILURE = 1.0, 2
FAULT_ENV = {
    "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": str(HEARTBEAT_S),
    "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": str(MAX_FAILURE),
    "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "5",
    "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "20",
}
FLAGS = ("--max-total-tokens", "4096", "--page-size", "4", "--chunked-prefill-size", "64")


def fault_cluster(backend: str, model_path: str, env: dict[str, str] | None = None
                  ) -> PDCluster:
    return PDCluster(backend, model_path=model_path, flags=FLAGS,
                     env={**FAULT_ENV, **(env or {})}).start()


def _body(k: int, n: int = 200, **extra: Any) -> dict[str, Any]:
    return {"text": f"{k} " + "word " * n, "sampling_params": {
        "max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True}, **extra}


def _pd_body(c: PDCluster, room: int, **kw: Any) -> dict[str, Any]:
    return _body(room, bootstrap_host="127.0.0.1", bootstrap_port=c.bootstrap_ports[0],
                 bootstrap_room=room, **kw)


def _post_async(url: str, body: dict[str, Any], out: list, timeout: float = 120.0
                ) -> threading.Thread:
    def run() -> None:
        t0 = time.monotonic()
        try:
            r = httpx.post(url + "/generate", json=body, timeout=timeout)
            out.append((r.status_code, r.text, time.monotonic()))
        except httpx.HTTPError as e:
            out.append((0, repr(e), time.monotonic()))
        _ = t0

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _stats(url: str) -> dict[str, Any]:
    return httpx.get(url + "/get_load", timeout=10).json()[0]


def _wait(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.1)


def server_pids(server: Any) -> set[int]:
    """The pids of a running server's process tree (HTTP process, scheduler, TP ranks)."""
    pids, todo = set(), [server.proc.pid]
    while todo:
        pid = todo.pop()
        pids.add(pid)
        todo.extend(spawned_children(pid))
    return pids


def dead_owner_segments(owners: set[int] | None = None) -> list[str]:
    """pdserve shared-memory segments whose owner process is gone (must be none after the
    survivors and restarted servers ran their clean-up); only those of `owners` when given (other
    tests of this machine may be killing servers of their own meanwhile)."""
    from pdcore.builtin import shm_segment as seg

    out = []
    for name in os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else []:
        pid = seg.owner_pid(name) if name.startswith(seg.PREFIX) else None
        if pid is None or (owners is not None and pid not in owners):
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            out.append(name)
        except PermissionError:
            pass
    return out


def kill_prefill_in_flight(c: PDCluster) -> None:
    """Requests stuck on a dead P fail on D within heartbeat x max failures + slack; D stays
    healthy with every page free; a restarted P serves new requests with no D restart."""
    p, d = c.prefills[0], c.decodes[0]
    owners = server_pids(p)
    os.killpg(p.proc.pid, signal.SIGSTOP)  # freeze P so the requests are surely in flight
    results: list = []
    threads = [_post_async(d.url, _pd_body(c, 1000 + k), results) for k in range(4)]
    _wait(lambda: _stats(d.url).get("disagg_prealloc_queue", 0)
          + _stats(d.url).get("disagg_transfer_queue", 0) >= 4, 30, "D to hold 4 requests")
    p.kill()
    killed = time.monotonic()
    for t in threads:
        t.join(60)
    assert len(results) == 4, "a request hung on D after its prefill died"
    for status, text, when in results:
        assert status >= 500, f"expected an error, got {status}: {text}"
        assert "prefill" in text.lower(), text
        assert when - killed <= HEARTBEAT_S * MAX_FAILURE + 6.0, f"took {when - killed:.1f}s"
    assert httpx.get(d.url + "/health", timeout=5).status_code == 200
    c.wait_pages_free(15)
    p.start().wait_healthy(300)  # same HTTP and bootstrap ports
    _wait(lambda: httpx.get(c.url + "/readiness", timeout=5).status_code == 200, 30,
          "the router to re-admit the restarted prefill")
    r = httpx.post(c.url + "/generate", json=_body(7, n=20), timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["completion_tokens"] == 16
    c.wait_pages_free(15)
    assert dead_owner_segments(owners) == [], "segments of the killed prefill were left behind"


def kill_decode_mid_transfer(c: PDCluster) -> None:
    """P frees every page of a dead D's requests within its timeout and stays healthy; a
    restarted D registers again and serves new requests."""
    p, d = c.prefills[0], c.decodes[0]
    results: list = []
    threads = []
    for k in range(6):
        body = _pd_body(c, 2000 + k, n=400)
        threads.append(_post_async(p.url, body, results))
        threads.append(_post_async(d.url, body, []))
    _wait(lambda: not load_at_rest(_stats(p.url)) or len(results) == 6, 30,
          "P to start prefilling")
    owners = server_pids(d)
    d.kill()
    killed = time.monotonic()
    for t in threads:
        t.join(60)
    assert len(results) == 6, "a request hung on P after its decode died"
    c_timeout = float(FAULT_ENV["SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT"])
    _wait(lambda: load_at_rest(_stats(p.url)),
          c_timeout + 10, "P to free the dead decode's pages")
    assert time.monotonic() - killed <= c_timeout + 10
    assert httpx.get(p.url + "/health", timeout=5).status_code == 200
    d.start().wait_healthy(300)
    _wait(lambda: httpx.get(c.url + "/readiness", timeout=5).status_code == 200, 30,
          "the router to re-admit the restarted decode")
    r = httpx.post(c.url + "/generate", json=_body(8, n=20), timeout=120)
    assert r.status_code == 200, r.text
    c.wait_pages_free(15)
    assert dead_owner_segments(owners) == [], "segments of the killed decode were left behind"


def client_disconnect_mid_stream(c: PDCluster) -> None:
    """A client that goes away mid-stream frees the pages on both sides."""
    body = _body(9, n=50)
    body["sampling_params"]["max_new_tokens"] = 2000
    body["stream"] = True
    with httpx.stream("POST", c.url + "/generate", json=body, timeout=60) as r:
        assert r.status_code == 200
        seen = 0
        for line in r.iter_lines():
            if line.startswith("data: {"):
                seen += 1
                if seen == 3:
                    break
    c.wait_pages_free(15)
