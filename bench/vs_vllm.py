"""pdserve against vLLM on the same CPU, in one run: same model folder, same client, same shape.

Systems (--systems): pdserve-unified (`pdserve serve`, its defaults: no thread variable set by
hand), pdserve-1p1d (`pdserve up`: 1 prefill + 1 decode + router, shm, the CPUs split by
`up`), vllm-unified (`vllm serve`, VLLM_CPU_OMP_THREADS_BIND=--vllm-bind, both cores by
default). vLLM runs when --vllm-python names a Python with vllm installed (its own venv, see
shared/reference/vllm-cpu.md) and --model-path is an HF folder; otherwise the run measures
pdserve alone and its JSON says why vLLM is missing. vLLM 1P1D needs a proxy that speaks its
kv_transfer_params protocol, which this script does not have yet (listed as skipped).

Lifecycle, per round (--rounds, order alternating between rounds): start one system alone on
the machine, warm it up, run the closed-loop client of bench/serving.py (streamed
/v1/completions of random token-id prompts, --input-len in / --output-len out, ignore_eos,
greedy, --concurrency in flight, --num-prompts), stop it. Per system: output tok/s (median over
rounds), mean TTFT and TPOT; ratios pdserve / vLLM; JSON + PNG in bench/results/vs_vllm.*.
Timings are only meaningful on an otherwise idle machine: the load average is recorded.

Run: `python bench/vs_vllm.py --model-path DIR [--vllm-python VENV/bin/python] [--dtype
bfloat16]`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx
from common import Run, alternating, figure, load_note, ratio, save_figure
from serving import closed_loop, latency_stats, random_prompts

NAME = "vs_vllm"
SYSTEMS = ("pdserve-unified", "pdserve-1p1d", "vllm-unified")
VLLM_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
            "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "2",
            "VLLM_HOST_IP": "127.0.0.1"}


class Proc:
    """A server (or `pdserve up`) in its own process group, log in a temp file."""

    def __init__(self, argv: list[str], url: str, env: dict[str, str] | None = None) -> None:
        self.url = url
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - closed in stop()
            prefix="vs_vllm-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})}, start_new_session=True)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"exited with {self.proc.returncode}; log {self.log.name}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError(f"not ready after {timeout:.0f}s; log {self.log.name}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log.close()


def free_port() -> int:
    from pdcore.testing.processes import free_port as fp

    return fp()


def start(system: str, args: argparse.Namespace) -> Proc:
    py, port = sys.executable, free_port()
    model = ["--model-path", args.model_path] if args.model_path else []
    if system == "pdserve-unified":
        argv = [py, "-m", "pdcore", "serve", "--host", "127.0.0.1", "--port", str(port),
                "--dtype", args.dtype, *model]
    elif system == "pdserve-1p1d":
        argv = [py, "-m", "pdcore", "up", "--port", str(port), "--server-port-base",
                str(free_port()), "--bootstrap-port-base", str(free_port()),
                *model, "--dtype", args.dtype]
    elif system == "vllm-unified":
        argv = [str(Path(args.vllm_python).parent / "vllm"), "serve", args.model_path,
                "--dtype", args.dtype, "--host", "127.0.0.1", "--port", str(port),
                "--max-model-len", "2048", "--served-model-name", "model"]
        env = {**VLLM_ENV, "VLLM_CPU_OMP_THREADS_BIND": args.vllm_bind}
        return Proc(argv, f"http://127.0.0.1:{port}", env)
    else:
        raise ValueError(system)
    return Proc(argv, f"http://127.0.0.1:{port}")


def vllm_missing(args: argparse.Namespace) -> str | None:
    if not args.vllm_python:
        return "no --vllm-python given"
    r = subprocess.run([args.vllm_python, "-c", "import vllm"], capture_output=True,
                       timeout=300, check=False)
    if r.returncode != 0:
        return f"{args.vllm_python} cannot import vllm"
    if not (args.model_path and Path(args.model_path, "config.json").is_file()):
        return "vLLM needs --model-path to be an HF folder"
    return None


def vocab(args: argparse.Namespace) -> int:
    from pdcore.engine.model_loader import load_config
    from pdcore.engine.tokenizer import resolve_model

    return int(load_config(resolve_model(args.model_path)).vocab_size)


def one_round(system: str, args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    proc = start(system, args)
    try:
        proc.wait_ready(args.startup_timeout)
        asyncio.run(closed_loop(proc.url, prompts[: args.concurrency], 4, args.concurrency))
        results, wall = asyncio.run(closed_loop(proc.url, prompts, args.output_len,
                                                args.concurrency))
    finally:
        proc.stop()
    stats = latency_stats(results)
    return {"tok_s": stats["output_tokens"] / wall, "wall_s": wall,
            "mean_ttft_s": stats["ttft_s"].get("mean"), "mean_tpot_s": stats["tpot_s"].get("mean"),
            "errors": stats["errors"], "error_samples": stats["error_samples"]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", default=None, help="HF folder (vLLM needs one)")
    ap.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON"))
    ap.add_argument("--vllm-bind", default="0-1", help="VLLM_CPU_OMP_THREADS_BIND for vLLM")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--out-dir", type=Path, default=None)
    args = ap.parse_args(argv)
    run = Run(NAME, {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()})
    systems = [s for s in args.systems.split(",") if s]
    skipped = {}
    missing = vllm_missing(args) if any(s.startswith("vllm") for s in systems) else None
    if missing:
        skipped.update({s: missing for s in systems if s.startswith("vllm")})
        systems = [s for s in systems if not s.startswith("vllm")]
    prompts = random_prompts(args.num_prompts, args.input_len, vocab(args), seed=0)
    rounds: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
    for rep in range(args.rounds):
        for s in alternating(systems, rep):
            rounds[s].append(one_round(s, args, prompts))
            print(f"round {rep} {s}: {rounds[s][-1]['tok_s']:.1f} tok/s", flush=True)
    med = {s: {k: statistics.median(r[k] for r in v if r[k] is not None)
               for k in ("tok_s", "mean_ttft_s", "mean_tpot_s")} for s, v in rounds.items()}
    ratios = {}
    if "vllm-unified" in med:
        for s in ("pdserve-unified", "pdserve-1p1d"):
            if s in med:
                ratios[f"{s}_over_vllm_unified_tok_s"] = ratio(med[s]["tok_s"],
                                                               med["vllm-unified"]["tok_s"])
    data = {"systems": systems, "skipped": skipped, "rounds": rounds, "median": med,
            "ratios": ratios, "vllm_measured": "vllm-unified" in med}
    path = run.finish(data, args.out_dir)
    note = load_note(run)
    plot(data, args, note)
    if skipped:
        print("pdserve alone: vLLM not measured (" + "; ".join(
            f"{k}: {v}" for k, v in skipped.items()) + ")")
    for s, m in med.items():
        print(f"  {s:16s} {m['tok_s']:7.1f} tok/s  TTFT {m['mean_ttft_s'] or 0:.2f} s  "
              f"TPOT {(m['mean_tpot_s'] or 0) * 1000:.0f} ms")
    print("RATIOS " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
    print(f"({note}) -> {path}")
    return data


def plot(data: dict[str, Any], args: argparse.Namespace, note: str) -> None:
    fig, (a, b) = figure(2, 4.5, 3.8)
    names = list(data["median"])
    a.bar(names, [data["median"][s]["tok_s"] for s in names], color="C0")
    a.set_ylabel("output tok/s (median over rounds)")
    b.bar(names, [(data["median"][s]["mean_tpot_s"] or 0) * 1000 for s in names], color="C1")
    b.set_ylabel("mean TPOT (ms)")
    for ax in (a, b):
        ax.tick_params(axis="x", labelsize=7, rotation=15)
    fig.suptitle(f"{NAME}: {args.dtype}, {args.input_len} in / {args.output_len} out, "
                 f"concurrency {args.concurrency}; {note}", fontsize=9)
    save_figure(fig, NAME, args.out_dir)


if __name__ == "__main__":
    main()
