"""Chaos through `pdserve up` with two routers (#49's acceptance run; this is its bench).

`pdserve up --prefill 2 --decode 2 --routers 2` (a tiny random model unless --model-path), then
closed-loop clients, each streaming greedy /generate requests through a client-side list of
both routers (pdcore.testing.router_list: a router that does not answer, breaks a stream or
sends nothing for --stall-s is left for the other), each answer checked against an undisturbed
run. Every --interval-s one
fault, drawn at random (seeded): kill -9 of a server's HTTP process or of its scheduler, SIGSTOP
of a server for --stop-s (then SIGCONT), kill -9 or SIGSTOP of one router. After each fault:
its recovery time, until every server and router answers /health again and both routers have
every server back in rotation; the next fault comes --interval-s after that. At the end:
requests ok / failed / wrong / hung, pages at rest on every server (leaked otherwise), and the
table of recovery times; bench/results/chaos.json (chaos_quick.json for --quick; + .png: each
request's latency against its start, faults marked).

    python bench/chaos.py --quick                 # 2 minutes, a fault every 15 s
    python bench/chaos.py --duration-s 1200 --model-path SmolLM2.gguf   # #49's acceptance run
    (the default model's file: python -c "from pdcore.engine.model.source import
    default_model_file; print(default_model_file())")
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Run, figure, save_figure, summary  # noqa: E402

from pdcore.testing.pages import load_at_rest  # noqa: E402
from pdcore.testing.processes import spawned_children  # noqa: E402
from pdcore.testing.router_list import RouterList  # noqa: E402

PROMPTS = ["Hello there", "The capital of France is", "One two three four",
           "Once upon a time", "Write a haiku about the sea"]
FAULTS = ("kill_http", "kill_scheduler", "stop_server", "kill_router", "stop_router")


def body(prompt: str, n: int) -> dict[str, Any]:
    return {"text": prompt, "stream": True,
            "sampling_params": {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}}


def pids_with(arg: str) -> list[int]:
    """Processes with `arg` as one of their command-line words."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    words = f.read().split(b"\0")
            except OSError:
                continue
            if arg.encode() in words:
                out.append(int(entry))
    return out


class Fleet:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.routers = [f"http://127.0.0.1:{args.port + k}" for k in range(2)]
        self.servers = {f"prefill-{i}": args.server_port_base + i for i in range(args.prefill)}
        self.servers.update({f"decode-{j}": args.server_port_base + 100 + j
                             for j in range(args.decode)})
        self.state = Path(tempfile.mkdtemp(prefix="pdserve-chaos-"))
        self.log = self.state / "up.log"
        self.up: subprocess.Popen | None = None

    def start(self, model: str) -> None:
        a = self.args
        cmd = [sys.executable, "-m", "pdcore", "up", "--prefill", str(a.prefill), "--decode",
               str(a.decode), "--routers", "2", "--port", str(a.port), "--server-port-base",
               str(a.server_port_base), "--bootstrap-port-base", str(a.bootstrap_port_base),
               "--state-dir", str(self.state / "s"), "--model-path", model, "--backend",
               a.backend, "--skip-server-warmup", "--max-total-tokens", "4096",
               "--page-size", "4", "--drain-timeout", "10"]
        with open(self.log, "ab") as out:
            self.up = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                       start_new_session=True)
        deadline = time.monotonic() + 900
        while "pdserve up: ready at" not in self.log.read_text():
            if self.up.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"up did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(1)

    def stop(self) -> None:
        if self.up is not None and self.up.poll() is None:
            self.up.send_signal(signal.SIGTERM)
            try:
                self.up.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.up.pid, signal.SIGKILL)
                self.up.wait(10)

    def http_pid(self, port: int) -> int | None:
        """The server (or router) process listening on `port`: its own --port word, not up's."""
        assert self.up is not None
        found = [p for p in pids_with(str(port)) if p != self.up.pid]
        return found[0] if found else None

    def recovered(self, http: httpx.Client) -> bool:
        """Every server and router healthy, and every server available in both routers."""
        try:
            for port in self.servers.values():
                if http.get(f"http://127.0.0.1:{port}/health").status_code != 200:
                    return False
            for r in self.routers:
                listed = http.get(r + "/workers").json()["workers"]
                if len(listed) != len(self.servers) or not all(w["available"] for w in listed):
                    return False
            return True
        except (httpx.HTTPError, ValueError, KeyError):
            return False

    def pages_at_rest(self, http: httpx.Client) -> bool:
        try:
            loads = [x for port in self.servers.values()
                     for x in http.get(f"http://127.0.0.1:{port}/get_load").json()]
            return all(load_at_rest(x) for x in loads)
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return False


def inject(fleet: Fleet, kind: str, rng: random.Random, stop_s: float) -> str:
    """One fault; what it hit."""
    if kind in ("kill_router", "stop_router"):
        k = rng.randrange(2)
        target, port = f"router-{k}", fleet.args.port + k
    else:
        target = rng.choice(sorted(fleet.servers))
        port = fleet.servers[target]
    pid = fleet.http_pid(port)
    if pid is None:
        return f"{target}: not running"
    if kind == "kill_scheduler":
        kids = spawned_children(pid)
        if not kids:
            return f"{target}: no scheduler"
        os.kill(kids[0], signal.SIGKILL)
    elif kind in ("kill_http", "kill_router"):
        os.kill(pid, signal.SIGKILL)
    else:  # SIGSTOP the process (a server: with its scheduler), SIGCONT after stop_s
        group = [pid, *spawned_children(pid)]
        for p in group:
            os.kill(p, signal.SIGSTOP)

        def resume() -> None:
            time.sleep(stop_s)
            for p in group:
                try:
                    os.kill(p, signal.SIGCONT)
                except ProcessLookupError:
                    pass

        threading.Thread(target=resume, daemon=True).start()
    return target


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--prefill", type=int, default=2)
    ap.add_argument("--decode", type=int, default=2)
    ap.add_argument("--backend", default="tcp")
    ap.add_argument("--duration-s", type=float, default=1200.0)
    ap.add_argument("--interval-s", type=float, default=30.0)
    ap.add_argument("--stop-s", type=float, default=10.0, help="how long a SIGSTOP lasts")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--hung-s", type=float, default=120.0)
    ap.add_argument("--stall-s", type=float, default=20.0,
                    help="a client leaves a router that sent nothing for this long (frozen)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="120 s, a fault every 15 s")
    ap.add_argument("--port", type=int, default=28100)
    ap.add_argument("--server-port-base", type=int, default=38100)
    ap.add_argument("--bootstrap-port-base", type=int, default=39100)
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args()
    if args.quick:
        args.duration_s, args.interval_s, args.stop_s, args.clients = 120.0, 15.0, 5.0, 2
    name = "chaos_quick" if args.quick else "chaos"
    run = Run(name, vars(args))
    fleet = Fleet(args)
    model = args.model_path
    if model is None:
        from pdcore.engine.model.tokenizer import default_model_file
        from pdcore.testing.tiny_models import make_tiny_model

        model = make_tiny_model(str(fleet.state / "tiny"), tokenizer_from=default_model_file(),
                                max_positions=8192)
    rng = random.Random(args.seed)
    results: list[dict[str, Any]] = []
    faults: list[dict[str, Any]] = []
    at_rest = False
    try:
        fleet.start(model)
        routers = RouterList(fleet.routers, timeout=args.hung_s)
        with httpx.Client() as http:
            ref = {p: routers.generate(http, body(p, args.max_new_tokens)).text for p in PROMPTS}
        t_base = time.monotonic()
        stop = threading.Event()

        def client(k: int) -> None:
            mine = RouterList(fleet.routers[k % 2:] + fleet.routers[:k % 2], args.hung_s,
                              stall_s=args.stall_s)
            with httpx.Client() as c:
                i = k
                while not stop.is_set():
                    p = PROMPTS[i % len(PROMPTS)]
                    i += 1
                    t0 = time.monotonic()
                    o = mine.generate(c, body(p, args.max_new_tokens))
                    results.append({"t": t0 - t_base, "latency_s": time.monotonic() - t0,
                                    "status": o.status, "fell_over": o.fell_over,
                                    "wrong": o.status == 200 and o.text != ref[p],
                                    "error": "" if o.status == 200 else o.text[:200]})
                    if o.status != 200:
                        time.sleep(0.2)

        threads = [threading.Thread(target=client, args=(k,), daemon=True)
                   for k in range(args.clients)]
        for t in threads:
            t.start()
        with httpx.Client(timeout=3) as http:
            while time.monotonic() - t_base < args.duration_s:
                time.sleep(min(args.interval_s, max(0.0, args.duration_s -
                                                    (time.monotonic() - t_base))))
                if time.monotonic() - t_base >= args.duration_s:
                    break
                kind = rng.choice(FAULTS)
                t_fault = time.monotonic()
                target = inject(fleet, kind, rng, args.stop_s)
                time.sleep(0.5)
                while not fleet.recovered(http) and time.monotonic() - t_fault < 300:
                    time.sleep(0.2)
                rec = {"t": t_fault - t_base, "fault": kind, "target": target,
                       "recovery_s": round(time.monotonic() - t_fault, 2),
                       "recovered": fleet.recovered(http)}
                faults.append(rec)
                print(f"{rec['t']:7.1f}s {kind:<15} {target:<10} recovered in "
                      f"{rec['recovery_s']:.1f}s", flush=True)
        stop.set()
        for t in threads:
            t.join(args.hung_s + 10)
        with httpx.Client(timeout=5) as http:
            deadline = time.monotonic() + 60
            while not (at_rest := fleet.pages_at_rest(http)) and time.monotonic() < deadline:
                time.sleep(0.5)
    finally:
        fleet.stop()
    failed = [r for r in results if r["status"] != 200]
    by_kind: dict[str, list[float]] = {}
    for f in faults:
        by_kind.setdefault(f["fault"], []).append(f["recovery_s"])
    totals = {"requests": len(results), "ok": len(results) - len(failed), "failed": len(failed),
              "wrong": sum(r["wrong"] for r in results),
              "hung": sum(r["status"] == "hung" for r in results),
              "fell_over": sum(1 for r in results if r["fell_over"]),
              "leaked_pages": not at_rest, "faults": len(faults)}
    data = {"totals": totals, "faults": faults,
            "recovery_by_fault": {k: summary(v) for k, v in by_kind.items()},
            "failures": failed[:50], "requests": results, "up_log": str(fleet.log)}
    path = run.finish(data, Path(args.out_dir) if args.out_dir else None)
    plot(results, faults, name, Path(args.out_dir) if args.out_dir else None)
    print(f"wrote {path}\n{totals}")
    for k, v in sorted(by_kind.items()):
        print(f"  {k:<15} n={len(v)}  recovery s: " + ", ".join(f"{x:.1f}" for x in v))
    return 0


def plot(results: list[dict[str, Any]], faults: list[dict[str, Any]], name: str,
         out_dir: Path | None) -> None:
    fig, (ax,) = figure(1, width=10.0, height=4.0)
    for ok, color, label in ((True, "tab:green", "ok"), (False, "tab:red", "failed/wrong")):
        rows = [r for r in results if (r["status"] == 200 and not r["wrong"]) == ok]
        ax.scatter([r["t"] for r in rows], [r["latency_s"] for r in rows], s=6, c=color,
                   label=label)
    for f in faults:
        ax.axvline(f["t"], color="tab:gray", alpha=0.4)
        ax.text(f["t"], ax.get_ylim()[1] * 0.95, f["fault"], rotation=90, fontsize=6,
                va="top")
    ax.set_xlabel("request start, s")
    ax.set_ylabel("latency, s")
    ax.legend(fontsize=7)
    save_figure(fig, name, out_dir)


if __name__ == "__main__":
    sys.exit(main())
