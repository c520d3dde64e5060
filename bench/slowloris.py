"""Slowloris and connection-flood probes (#30 item 3) against a real server and router on
127.0.0.1, in two settings side by side in one run: `bounded` (the defaults: 4096 connections,
10 s header deadline) and `cap` (no header deadline to speak of and the connection limit at its
cap, the descriptor limit less 512: what still saves the port then is evicting the connection
that waited longest for its headers; without the gate, uvicorn ran out of descriptors and
/health went unanswered, as tests/faults/test_slowloris.py shows on the old code).

Per target (server, router) and mode (bounded, unbounded):
1. start a tiny-model `pdserve serve` and a `pdserve router` in front of it (the one server as
   both workers);
2. baseline: --probes GET /health latencies;
3. slowloris: --sockets connections (default 20,000, opened by --clients processes, each with
   its own descriptor limit) send the start of a request and hold; /health is probed every
   0.2 s while they connect (`while_connecting`: a burst of 20,000 connects can overflow the
   kernel's accept queue, and a probe whose SYN is dropped waits a second for its retransmit)
   and then during --hold seconds (a probe that gets no answer in 5 s counts as failed);
4. flood: the same processes connect and close as fast as they can for --hold seconds while
   /health is probed;
5. the target's /metrics (pdserve_http_connections*) and how many log lines it wrote.
JSON + PNG in bench/results/slowloris.*. Not a timed test: numbers only mean something on an
otherwise idle machine.

Run: `python bench/slowloris.py [--sockets 20000] [--hold 20] [--clients 2]`.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx
from common import Run, figure, save_figure, summary

from pdcore.engine.model.tokenizer import default_model_file
from pdcore.testing.processes import ServerProcess
from pdcore.testing.tiny_models import make_tiny_model

NAME = "slowloris"
PARTIAL = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-a: "
CAP_ONLY = {"PDSERVE_HTTP_MAX_CONNECTIONS": "1000000", "PDSERVE_HTTP_HEADER_TIMEOUT_S": "86400",
             "PDSERVE_HTTP_BODY_TIMEOUT_S": "86400"}


def _raise_nofile() -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _attacker(port: int, n: int, mode: str, stop: Any, opened: Any) -> None:
    """One client process: `n` half-open requests held until `stop` (slowloris), or connect and
    close in a loop until `stop` (flood)."""
    _raise_nofile()
    held: list[socket.socket] = []
    if mode == "slowloris":
        for _ in range(n):
            if stop.is_set():
                break
            s = socket.socket()
            s.settimeout(3)
            try:
                s.connect(("127.0.0.1", port))
                s.sendall(PARTIAL)
                held.append(s)
                with opened.get_lock():
                    opened.value += 1
            except OSError:
                s.close()
        stop.wait()
    else:
        while not stop.is_set():
            s = socket.socket()
            s.settimeout(1)
            try:
                s.connect(("127.0.0.1", port))
                with opened.get_lock():
                    opened.value += 1
            except OSError:
                pass
            finally:
                s.close()
    for s in held:
        s.close()


def _probe(url: str) -> float | None:
    t0 = time.perf_counter()
    try:
        r = httpx.get(url + "/health", timeout=5)
    except httpx.HTTPError:
        return None
    return time.perf_counter() - t0 if r.status_code == 200 else None


def _probes(url: str, seconds: float, until: Any = None) -> dict[str, Any]:
    lat, failed, end = [], 0, time.monotonic() + seconds
    while (until() is False) if until is not None else time.monotonic() < end:
        v = _probe(url)
        if v is None:
            failed += 1
        else:
            lat.append(v)
        time.sleep(0.2)
    return {"ok": len(lat), "failed": failed, "latency_s": summary(lat) if lat else None}


def _metrics(url: str) -> dict[str, float]:
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    return {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
            if line.startswith("pdserve_http_connections")}


def attack(proc: ServerProcess, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    port = int(proc.url.rsplit(":", 1)[1])
    ctx = mp.get_context("fork")
    stop, opened = ctx.Event(), ctx.Value("i", 0)
    lines = len(proc.log().splitlines())
    workers = [ctx.Process(target=_attacker, args=(port, args.sockets // args.clients, mode,
                                                   stop, opened), daemon=True)
               for _ in range(args.clients)]
    t0 = time.monotonic()
    for w in workers:
        w.start()
    if mode == "slowloris":  # probed while the sockets connect, then while they are held
        connecting = _probes(proc.url, 0.0, until=lambda: opened.value >= args.sockets
                             or time.monotonic() - t0 > 60)
        connecting["seconds"] = time.monotonic() - t0
    else:
        time.sleep(1.0)  # let the flood get going
    during = _probes(proc.url, args.hold)
    if mode == "slowloris":
        during["while_connecting"] = connecting
    during["connections_opened"] = opened.value
    stop.set()
    for w in workers:
        w.join(30)
    time.sleep(1.0)
    during["after"] = _probes(proc.url, 2.0)
    during["metrics"] = _metrics(proc.url)
    log = proc.log().splitlines()[lines:]
    during["log_lines"] = len(log)
    during["log_tracebacks"] = sum("Traceback" in ln for ln in log)
    return during


def run_mode(mode: str, model: str, args: argparse.Namespace) -> dict[str, Any]:
    env = CAP_ONLY if mode == "cap" else {}
    server = ServerProcess("--model-path", model, "--max-total-tokens", "2048", env=env)
    server.wait_healthy(300)
    router = ServerProcess("--pd-disaggregation", "--prefill", server.url, "none", "--decode",
                           server.url.replace("127.0.0.1", "localhost"),
                           command=("-m", "pdcore.router"), env=env)
    out: dict[str, Any] = {}
    try:
        router.wait_healthy(120)
        for name, proc in (("router", router), ("server", server)):
            out[name] = {"baseline": _probes(proc.url, 3.0)}
            for kind in ("slowloris", "flood"):
                out[name][kind] = attack(proc, kind, args)
                r = out[name][kind]
                lat = r["latency_s"] or {}
                if "while_connecting" in r:
                    c = r["while_connecting"]
                    print(f"{mode:9s} {name:6s} connecting {args.sockets} sockets "
                          f"({c['seconds']:.1f} s): /health ok {c['ok']} failed {c['failed']} "
                          f"max {((c['latency_s'] or {}).get('max') or 0) * 1000:.0f} ms")
                print(f"{mode:9s} {name:6s} {kind:9s}: /health ok {r['ok']} failed {r['failed']}"
                      f" median {lat.get('p50', float('nan')) * 1000:.1f} ms max "
                      f"{lat.get('max', float('nan')) * 1000:.1f} ms; opened "
                      f"{r['connections_opened']}; log lines {r['log_lines']} (tracebacks "
                      f"{r['log_tracebacks']})", flush=True)
    finally:
        router.stop()
        server.stop()
    return out


def plot(data: dict[str, Any], note: str, machine: dict[str, Any]) -> None:
    fig, (a, b) = figure(2, 5.5, 3.8)
    labels, med, fail = [], [], []
    for mode, by_target in data["modes"].items():
        for target, res in by_target.items():
            for kind in ("baseline", "slowloris", "flood"):
                r = res[kind]
                labels.append(f"{mode}\n{target}\n{kind}")
                med.append(((r["latency_s"] or {}).get("max") or 0) * 1000)
                total = r["ok"] + r["failed"]
                fail.append(100.0 * r["failed"] / total if total else 0)
    a.bar(labels, med, color=["C0" if lb.startswith("bounded") else "C3" for lb in labels])
    a.set_ylabel("/health max latency (ms, answered probes)")
    b.bar(labels, fail, color=["C0" if lb.startswith("bounded") else "C3" for lb in labels])
    b.set_ylabel("/health probes unanswered (%)")
    for ax in (a, b):
        ax.tick_params(axis="x", labelsize=5, rotation=30)
    fig.suptitle(f"{NAME}: {data['sockets']} half-open sockets / connect flood, {note}\n"
                 f"{machine.get('cpu', '')}", fontsize=8)
    save_figure(fig, NAME, None)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sockets", type=int, default=20000)
    ap.add_argument("--clients", type=int, default=2, help="attacking processes")
    ap.add_argument("--hold", type=float, default=20.0, help="seconds each attack lasts")
    ap.add_argument("--modes", default="bounded,cap")
    args = ap.parse_args(argv)
    _raise_nofile()
    run = Run(NAME, vars(args))
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(os.path.join(tmp, "m"), seed=3,
                                tokenizer_from=default_model_file())
        modes = {m: run_mode(m, model, args) for m in args.modes.split(",") if m}
    data = {"sockets": args.sockets, "nofile": resource.getrlimit(resource.RLIMIT_NOFILE),
            "modes": modes}
    path = run.finish(data)
    plot(data, f"hold {args.hold:g} s", run.machine_start)
    print(f"-> {path}")
    return data


if __name__ == "__main__":
    main()
