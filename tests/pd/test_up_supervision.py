"""`pdserve up` supervises its servers (real processes on loopback, tiny random model, 1P1D):
killing the decode server's scheduler makes that server exit; `up` restarts it and the router
takes it back into rotation with no manual step. Requests sent meanwhile end with errors and
none hangs; afterwards requests succeed again.

The same cluster runs two routers (`--routers 2`, #49 item 3): the first one killed with
SIGKILL, every request sent to the second is served, and a client holding both (a client-side
list, pdcore.testing.router_list) falls over to the second; `up` restarts the first, which
takes over the second's worker list and serves again."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from pdserve_testing import REPO_ROOT, free_port

from pdcore.testing.processes import spawned_children
from pdcore.testing.router_list import RouterList

pytestmark = pytest.mark.timeout(420)
BODY = {"text": "Hello there", "sampling_params": {"max_new_tokens": 8, "temperature": 0.0}}


def _pids_with(arg: str) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmd = f.read().split(b"\0")
            except OSError:
                continue
            if arg.encode() in cmd:
                out.append(int(entry))
    return out




def _port_pair() -> int:
    """A base port with base and base + 100 both free and claimed (up puts decode at + 100)."""
    return free_port(offsets=(0, 100))


def _ok(url: str) -> bool:
    try:
        return httpx.post(url + "/generate", json=BODY, timeout=30).status_code == 200
    except httpx.HTTPError:
        return False


def test_up_restarts_a_dead_server_and_the_router_takes_it_back(tiny_llama_dir: Path,
                                                                tmp_path: Path) -> None:
    router_port, base, boot = free_port(offsets=(0, 1)), _port_pair(), free_port()
    url = f"http://127.0.0.1:{router_port}"
    log = tmp_path / "up.log"
    cmd = [sys.executable, "-m", "pdcore", "up", "--prefill", "1", "--decode", "1",
           "--backend", "tcp", "--model-path", str(tiny_llama_dir), "--port", str(router_port),
           "--server-port-base", str(base), "--bootstrap-port-base", str(boot),
           "--startup-timeout", "300", "--max-total-tokens", "4096", "--page-size", "4",
           "--skip-server-warmup", "--state-dir", str(tmp_path / "state"), "--routers", "2"]
    key_file = tmp_path / "state" / "admin_api_key"
    with open(log, "ab") as out:
        up = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=str(REPO_ROOT),
                              start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not _ok(url):
            assert up.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(1)
        # the live cluster page's URL is printed once all is up, and the router serves it
        while f"live cluster page: {url}/dashboard" not in log.read_text():
            assert up.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.5)
        assert httpx.get(url + "/dashboard", timeout=30).status_code == 200
        # the curl it prints to try is the router's chat route, and it answers (as pasted);
        # the servers' own ready lines show no curl (their ports answer the router only)
        text = log.read_text()
        [try_line] = [ln for ln in text.splitlines() if ln.strip().startswith("try: curl ")]
        assert try_line.strip()[len("try: "):].startswith(f"curl {url}/v1/chat/completions")
        tried = subprocess.run(["bash", "-c", try_line.strip()[len("try: "):] + " -sS"],
                               capture_output=True, text=True, timeout=120, check=True)
        assert json.loads(tried.stdout)["choices"][0]["message"]["role"] == "assistant", tried
        # the cluster's admin key: drawn, in a 0600 file whose path (not the key) is printed,
        # and it opens the admin routes the router fans out to its servers
        key = key_file.read_text().strip()
        assert oct(key_file.stat().st_mode & 0o777) == "0o600" and len(key) == 64
        assert f"in {key_file}" in log.read_text() and key not in log.read_text()
        assert httpx.post(url + "/flush_cache", timeout=30).status_code == 401
        r = httpx.post(url + "/flush_cache", headers={"authorization": f"Bearer {key}"},
                       timeout=30)
        assert r.status_code == 200 and all(x["ok"] for x in r.json()["results"]), r.text
        decode_port = str(base + 100)
        [decode_http] = [p for p in _pids_with(decode_port) if spawned_children(p)]
        [scheduler] = spawned_children(decode_http)

        results: list[Any] = []
        stop = threading.Event()

        def meanwhile() -> None:  # requests while decode is dead and restarting
            while not stop.is_set():
                t0 = time.monotonic()
                try:
                    r = httpx.post(url + "/generate", json=BODY, timeout=120)
                    results.append((r.status_code, time.monotonic() - t0))
                except httpx.HTTPError as e:
                    results.append((type(e).__name__, time.monotonic() - t0))
                time.sleep(0.2)

        t_kill = time.monotonic()
        os.kill(scheduler, signal.SIGKILL)
        sender = threading.Thread(target=meanwhile)
        sender.start()
        deadline = time.monotonic() + 30
        while decode_http in _pids_with(decode_port) and time.monotonic() < deadline:
            time.sleep(0.1)
        t_exit = time.monotonic() - t_kill
        assert t_exit < 10, "the decode server did not exit after its scheduler died"
        deadline = time.monotonic() + 240
        while True:  # restarted: a new HTTP process that answers /health
            assert up.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            try:
                if httpx.get(f"http://127.0.0.1:{decode_port}/health", timeout=2).status_code \
                        == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        t_healthy = time.monotonic()
        while not _ok(url):
            assert time.monotonic() - t_healthy < 60, "not back in rotation within 60 s"
            time.sleep(0.1)
        back_s = time.monotonic() - t_healthy
        stop.set()
        sender.join(150)
        assert not sender.is_alive(), "a request sent meanwhile hung"
        assert results and all(isinstance(s, int) or s for s, _ in results)
        failed = [r for r in results if r[0] != 200]
        assert failed, "no request failed while decode was down (was it really killed?)"
        assert all(code in (502, 503, 500) or isinstance(code, str) for code, _ in failed), failed
        for _ in range(3):
            assert _ok(url)
        text = log.read_text()
        assert "decode-0 exited with code 1; restarting in 1s" in text
        assert "decode-0 restarted" in text
        print(f"decode server exited {t_exit:.2f}s after its scheduler was killed; "
              f"healthy again {t_healthy - t_kill:.1f}s after the kill; back in rotation "
              f"{back_s:.2f}s after its /health answered; {len(failed)} of {len(results)} "
              "requests sent meanwhile failed, none hung")
        _second_router_serves_while_the_first_is_killed(up, log, router_port)
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGTERM)
            try:
                up.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(up.pid, signal.SIGKILL)
                up.wait(10)
    assert not key_file.exists(), "up left its admin key behind"


def _second_router_serves_while_the_first_is_killed(up: subprocess.Popen, log: Path,
                                                    router_port: int) -> None:
    first, second = (f"http://127.0.0.1:{router_port + k}" for k in (0, 1))
    assert f"2 routers, each serving any request (one address for all: docs/router.md): " \
           f"{first}, {second}" in log.read_text()
    ref = httpx.post(second + "/generate", json=BODY, timeout=60).json()["text"]
    [router0] = [p for p in _pids_with(str(router_port)) if p != up.pid]
    direct: list[Any] = []  # requests to the second router only
    listed: list[Any] = []  # a client-side list: the first router, then the second
    stop = threading.Event()

    def to_second() -> None:
        with httpx.Client() as http:
            while not stop.is_set():
                try:
                    r = http.post(second + "/generate", json=BODY, timeout=60)
                    direct.append((r.status_code, r.json().get("text")))
                except httpx.HTTPError as e:
                    direct.append((type(e).__name__, ""))

    def through_list(stream: bool) -> None:
        routers = RouterList([first, second], timeout=60)
        with httpx.Client() as http:
            while not stop.is_set():
                listed.append(routers.generate(http, {**BODY, "stream": stream}))

    threads = [threading.Thread(target=to_second)] + [
        threading.Thread(target=through_list, args=(s,)) for s in (False, True)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    os.kill(router0, signal.SIGKILL)
    t_kill = time.monotonic()
    while "router exited with code -9" not in log.read_text() or not _ok(first):
        assert time.monotonic() - t_kill < 90, log.read_text()[-3000:]
        assert up.poll() is None, log.read_text()[-3000:]
        time.sleep(0.2)
    back_s = time.monotonic() - t_kill
    time.sleep(1.0)
    stop.set()
    for t in threads:
        t.join(90)
        assert not t.is_alive(), "a request hung"
    assert direct and all(r == (200, ref) for r in direct), [r for r in direct if r != (200, ref)]
    bad = [o for o in listed if (o.status, o.text) != (200, ref)]
    assert listed and not bad, bad[:5]
    fell = [o for o in listed if o.fell_over]
    assert fell and all(o.router == second for o in fell), "the list never fell over"
    # the restarted router took the worker list of its peer, and its admin routes still work
    # with the cluster's key (it relays to the second router)
    workers = httpx.get(first + "/workers", timeout=30).json()
    assert workers["fleet"]["adopted_from"] == second, workers
    print(f"router killed: {len(direct)} requests to the other router, all served; "
          f"{len(listed)} through a client-side list ({len(fell)} fell over), all served; "
          f"the killed router served again {back_s:.1f}s after the kill")
