"""Router overhead: a request sent to a decode worker directly vs through `pdserve router`
(P + D fan-out), on the same instant-answer fake workers, measured side by side in one run.

Lifecycle:
1. fake prefill and decode workers start as uvicorn subprocesses of this script
   (`--fake-worker ROLE PORT`); they answer /generate at once (JSON, or SSE of --tokens events);
2. the router starts (`python -m pdcore.router`, round_robin); with --sglang-router the real
   sglang-router (PyPI) starts on the same workers too;
3. per mode (json, stream) and round: every target gets --requests requests at --concurrency,
   the target order shuffled per round, after one warm-up round;
4. p50/p99 latency (stream: also time to first byte), req/s, and CPU ms per request of the
   serving process (read from /proc, so a busy machine inflates latency but not this);
   RATIOS = router / direct (p50, throughput, CPU per request) and the added milliseconds;
   bench/results/router_overhead.json (+ .png).

Run: `python bench/router_overhead.py [--requests 300] [--concurrency 8] [--rounds 3]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


# -- fake worker (subprocess) ------------------------------------------------------------------
def serve_fake_worker(role: str, port: int, tokens: int) -> None:
    app = FastAPI()

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    async def sse(n: int):
        for i in range(n):
            yield f'data: {{"text": "t{i}", "meta_info": {{"input_token_logprobs": []}}}}\n\n'
        yield "data: [DONE]\n\n"

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        body = await request.json()
        if body.get("stream"):
            return StreamingResponse(sse(1 if role == "prefill" else tokens),
                                     media_type="text/event-stream")
        return JSONResponse({"text": "ok", "meta_info": {"input_token_logprobs": []}})

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


# -- helpers -----------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str]) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all threads), from /proc; robust to a busy machine."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: process exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} not healthy after {timeout} s")


async def run_load(url: str, stream: bool, n: int, concurrency: int) -> dict[str, float]:
    latencies: list[float] = []
    firsts: list[float] = []
    body = {"text": "hello world", "sampling_params": {"max_new_tokens": 8}, "stream": stream}
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(n):
        queue.put_nowait(i)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=30, limits=limits) as client:

        async def one_worker() -> None:
            while not queue.empty():
                queue.get_nowait()
                t0 = time.perf_counter()
                async with client.stream("POST", url + "/generate", json=body) as resp:
                    first, data = None, b""
                    async for chunk in resp.aiter_raw():
                        first = first or time.perf_counter()
                        data += chunk if resp.status_code != 200 else b""
                    if resp.status_code != 200:
                        raise RuntimeError(f"{url}: HTTP {resp.status_code}: {data[:300]!r}")
                latencies.append(time.perf_counter() - t0)
                firsts.append((first or time.perf_counter()) - t0)

        t0 = time.perf_counter()
        await asyncio.gather(*(one_worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    q = statistics.quantiles(latencies, n=100)
    return {"p50_ms": statistics.median(latencies) * 1e3, "p99_ms": q[98] * 1e3,
            "ttfb_p50_ms": statistics.median(firsts) * 1e3, "req_per_s": n / wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=16, help="SSE events per decode stream")
    ap.add_argument("--sglang-router", action="store_true", help="also measure sglang-router")
    ap.add_argument("--fake-worker", nargs=2, metavar=("ROLE", "PORT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.fake_worker:
        serve_fake_worker(args.fake_worker[0], int(args.fake_worker[1]), args.tokens)
        return

    procs: list[subprocess.Popen[bytes]] = []
    try:
        urls = {}
        for role in ("prefill", "decode"):
            port = free_port()
            procs.append(start([sys.executable, __file__, "--fake-worker", role, str(port),
                                "--tokens", str(args.tokens)]))
            urls[role] = f"http://127.0.0.1:{port}"
            wait_healthy(urls[role], procs[-1])
        targets = {"direct": urls["decode"]}
        pids = {"direct": procs[1].pid}
        port = free_port()
        procs.append(start([sys.executable, "-m", "pdcore.router", "--pd-disaggregation",
                            "--prefill", urls["prefill"], "--decode", urls["decode"],
                            "--port", str(port), "--policy", "round_robin",
                            "--log-level", "warning"]))
        targets["pdserve_router"] = f"http://127.0.0.1:{port}"
        pids["pdserve_router"] = procs[-1].pid
        wait_healthy(targets["pdserve_router"], procs[-1])
        if args.sglang_router:
            port = free_port()
            procs.append(start([sys.executable, "-m", "sglang_router.launch_router",
                                "--pd-disaggregation", "--prefill", urls["prefill"],
                                "--decode", urls["decode"], "--host", "127.0.0.1",
                                "--port", str(port), "--policy", "round_robin",
                                "--prometheus-host", "127.0.0.1",
                                "--prometheus-port", str(free_port())]))
            targets["sglang_router"] = f"http://127.0.0.1:{port}"
            pids["sglang_router"] = procs[-1].pid
            wait_healthy(targets["sglang_router"], procs[-1])

        results: dict[str, dict[str, list[dict[str, float]]]] = {}
        for mode in ("json", "stream"):
            results[mode] = {name: [] for name in targets}
            for rnd in range(args.rounds + 1):  # round 0 is the warm-up
                order = list(targets)
                random.shuffle(order)
                for name in order:
                    cpu0 = cpu_seconds(pids[name])
                    r = asyncio.run(run_load(targets[name], mode == "stream",
                                             args.requests, args.concurrency))
                    # CPU of the serving process itself: the decode worker for "direct"
                    r["server_cpu_ms_per_req"] = (cpu_seconds(pids[name]) - cpu0) * 1e3 / args.requests
                    if rnd:
                        results[mode][name].append(r)
        summary = summarize(results)
        out = {"config": vars(args) | {"fake_worker": None}, "runs": results, "summary": summary}
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "router_overhead.json").write_text(json.dumps(out, indent=2))
        report(summary)
        plot(summary)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()


def summarize(results: dict[str, dict[str, list[dict[str, float]]]]) -> dict[str, object]:
    summary: dict[str, object] = {}
    for mode, per_target in results.items():
        med = {name: {k: statistics.median(r[k] for r in runs) for k in runs[0]}
               for name, runs in per_target.items()}
        ratios = {}
        for name in med:
            if name == "direct":
                continue
            ratios[name] = {
                "p50_latency_ratio": med[name]["p50_ms"] / med["direct"]["p50_ms"],
                "added_p50_ms": med[name]["p50_ms"] - med["direct"]["p50_ms"],
                "throughput_ratio": med[name]["req_per_s"] / med["direct"]["req_per_s"],
                "server_cpu_ratio": med[name]["server_cpu_ms_per_req"]
                / med["direct"]["server_cpu_ms_per_req"],
            }
        summary[mode] = {"median_of_rounds": med, "ratios_vs_direct": ratios}
    return summary


def report(summary: dict[str, object]) -> None:
    for mode, data in summary.items():
        print(f"== {mode}")
        for name, m in data["median_of_rounds"].items():  # type: ignore[index]
            print(f"  {name:<15} p50 {m['p50_ms']:7.2f} ms  p99 {m['p99_ms']:7.2f} ms  "
                  f"ttfb {m['ttfb_p50_ms']:7.2f} ms  {m['req_per_s']:8.1f} req/s  "
                  f"server cpu {m['server_cpu_ms_per_req']:.2f} ms/req")
        for name, r in data["ratios_vs_direct"].items():  # type: ignore[index]
            print(f"  RATIO {name}/direct: p50 x{r['p50_latency_ratio']:.2f} "
                  f"(+{r['added_p50_ms']:.2f} ms), throughput x{r['throughput_ratio']:.2f}, "
                  f"server cpu/req x{r['server_cpu_ratio']:.2f}")


def plot(summary: dict[str, object]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, (mode, data) in zip(axes, summary.items()):
        med = data["median_of_rounds"]  # type: ignore[index]
        names = list(med)
        ax.bar(names, [med[n]["p50_ms"] for n in names], label="p50")
        ax.bar(names, [med[n]["p99_ms"] - med[n]["p50_ms"] for n in names],
               bottom=[med[n]["p50_ms"] for n in names], alpha=0.4, label="p99")
        ax.set_title(f"/generate {mode}: latency (ms)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "router_overhead.png", dpi=100)


if __name__ == "__main__":
    main()
