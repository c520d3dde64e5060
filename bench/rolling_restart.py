"""Rolling restarts under load (#49 item 2, the long version of tests/pd/test_rolling_restart.py).

`pdserve up --prefill P --decode D` (default 2P2D, the default model: SmolLM2) with --clients
closed-loop threads streaming greedy /generate requests through the router; `up` gets SIGHUP
--rounds times (each round drains and restarts every server in turn, waiting for its health
and the router's rotation before the next). Counted: requests ok / failed / wrong (text not the
undisturbed run's), hung (no answer within 120 s), latency of each request against the time it
started, and each round's duration. Writes bench/results/rolling_restart.json and .png.

    python bench/rolling_restart.py --rounds 3 --clients 4
    python bench/rolling_restart.py --model-path /path/to/tiny --rounds 1   # quick
"""

from __future__ import annotations

import argparse
import os
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

from pdcore.testing.router_list import read_stream  # noqa: E402

PROMPTS = ["Hello there", "The capital of France is", "One two three four",
           "Once upon a time", "Write a haiku about the sea"]


def _body(prompt: str, stream: bool, n: int) -> dict[str, Any]:
    return {"text": prompt, "stream": stream,
            "sampling_params": {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}}


def stream_once(http: httpx.Client, url: str, prompt: str, n: int) -> tuple[Any, str]:
    try:
        with http.stream("POST", url + "/generate", json=_body(prompt, True, n),
                         timeout=120) as r:
            return read_stream(r, cut=200)
    except httpx.TimeoutException:
        return "hung", ""
    except httpx.HTTPError as e:
        return type(e).__name__, str(e)[:200]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefill", type=int, default=2)
    ap.add_argument("--decode", type=int, default=2)
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--port", type=int, default=28000)
    ap.add_argument("--server-port-base", type=int, default=38000)
    ap.add_argument("--bootstrap-port-base", type=int, default=39000)
    args = ap.parse_args()
    run = Run("rolling_restart", vars(args))
    url = f"http://127.0.0.1:{args.port}"
    state = tempfile.mkdtemp(prefix="pdserve-rr-")
    log = Path(state) / "up.log"
    cmd = [sys.executable, "-m", "pdcore", "up", "--prefill", str(args.prefill), "--decode",
           str(args.decode), "--port", str(args.port), "--server-port-base",
           str(args.server_port_base), "--bootstrap-port-base", str(args.bootstrap_port_base),
           "--state-dir", state]
    if args.model_path:
        cmd += ["--model-path", args.model_path, "--skip-server-warmup"]
    with open(log, "ab") as out:
        up = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    results: list[dict[str, Any]] = []
    rounds: list[dict[str, float]] = []
    try:
        deadline = time.monotonic() + 900
        while "pdserve up: ready at" not in log.read_text():
            if up.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"up did not start:\n{log.read_text()[-3000:]}")
            time.sleep(1)
        with httpx.Client() as http:
            ref = {p: http.post(url + "/generate", json=_body(p, False, args.max_new_tokens),
                                timeout=300).json()["text"] for p in PROMPTS}
        t_base = time.monotonic()
        stop = threading.Event()

        def client(k: int) -> None:
            with httpx.Client() as c:
                i = k
                while not stop.is_set():
                    p = PROMPTS[i % len(PROMPTS)]
                    i += 1
                    t0 = time.monotonic()
                    status, text = stream_once(c, url, p, args.max_new_tokens)
                    results.append({"t": t0 - t_base, "latency_s": time.monotonic() - t0,
                                    "status": status, "ok": status == 200,
                                    "wrong": status == 200 and text != ref[p]})

        threads = [threading.Thread(target=client, args=(k,)) for k in range(args.clients)]
        for t in threads:
            t.start()
        time.sleep(5)
        for r in range(args.rounds):
            done_before = log.read_text().count("rolling restart done")
            t0 = time.monotonic()
            up.send_signal(signal.SIGHUP)
            while log.read_text().count("rolling restart done") == done_before:
                if "rolling restart stopped" in log.read_text() or up.poll() is not None:
                    raise SystemExit(f"rolling restart failed:\n{log.read_text()[-3000:]}")
                time.sleep(0.5)
            rounds.append({"round": r, "start_s": t0 - t_base,
                           "duration_s": time.monotonic() - t0})
            print(f"round {r}: {rounds[-1]['duration_s']:.1f}s, {len(results)} requests so far",
                  flush=True)
            time.sleep(5)
        stop.set()
        for t in threads:
            t.join(180)
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGTERM)
            try:
                up.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(up.pid, signal.SIGKILL)
    failed = [x for x in results if not x["ok"]]
    wrong = [x for x in results if x["wrong"]]
    data = {"requests": len(results), "failed": len(failed), "wrong": len(wrong),
            "hung": sum(1 for x in failed if x["status"] == "hung"),
            "failures": [x["status"] for x in failed][:50], "rounds": rounds,
            "latency_s": summary([x["latency_s"] for x in results]) if results else {},
            "samples": results}
    path = run.finish(data)
    fig, axes = figure(1, width=9)
    ax = axes[0]
    ax.scatter([x["t"] for x in results if x["ok"]],
               [x["latency_s"] for x in results if x["ok"]], s=4, label="ok")
    ax.scatter([x["t"] for x in failed], [x["latency_s"] for x in failed], s=12, c="red",
               label="failed")
    for rd in rounds:
        ax.axvspan(rd["start_s"], rd["start_s"] + rd["duration_s"], alpha=0.15, color="gray")
    ax.set_xlabel("request start (s); gray: a rolling restart of every server")
    ax.set_ylabel("request latency (s)")
    ax.set_title(f"{args.prefill}P{args.decode}D rolling restarts: {len(results)} requests, "
                 f"{len(failed)} failed, {len(wrong)} wrong")
    ax.legend()
    save_figure(fig, "rolling_restart")
    print(f"{path}: {len(results)} requests, {len(failed)} failed, {len(wrong)} wrong")


if __name__ == "__main__":
    main()
