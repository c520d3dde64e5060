"""vLLM's own decode step against its GEMMs at one batch size, from vLLM's torch profiler.

Issue #21's fallback clause asks whether vLLM's decode step is already within 1.2 x of the time
of its GEMMs at batch 8 (then 1.2 x vLLM is beyond the machine). This module measures that on
the running vLLM, not on a re-implementation: it starts `vllm serve` with
`--profiler-config` (torch profiler, CPU activity, no stacks or shapes, frontend not profiled),
sends `batch` streamed requests, and once every one of them has its first token (all prefills
done, the batch is decoding) calls /start_profile, waits for `steps` more tokens on every
stream, and calls /stop_profile. In the worker's trace each engine iteration is one
`execute_..._context_0(0)_generation_<batch>(...)` annotation (a pure decode step of the whole
batch); inside it, the GEMM ops (oneDNN / MKL / aten matmul kernels, attention excluded) are
summed top-level only, so a linear and the mm it calls count once. Profiling adds a little
per-op overhead to the step, so the ratio errs on the high side (favours the clause).
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import re
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from serving import Result, closed_loop, stream_completion
from vllm_launch import Group, free_port, vllm_serve

DECODE_STEP = re.compile(r"^execute_\d*_?context_0\(.*_generation_(\d+)\(")
GEMM = re.compile(r"onednn|mkldnn|mkl_linear|_mkl|gemm|^aten::(mm|addmm|bmm|matmul|linear)$|"
                  r"_linear", re.IGNORECASE)
NOT_GEMM = re.compile(r"attn|attention", re.IGNORECASE)
TRACE_WAIT_S = 120.0


def is_gemm(name: str) -> bool:
    return bool(GEMM.search(name)) and not NOT_GEMM.search(name)


def load_events(trace_dir: Path) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    for f in sorted(trace_dir.rglob("*.json*")):
        opener = gzip.open if f.suffix == ".gz" else open
        with opener(f, "rt") as fh:
            trace = json.load(fh)
        events += [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    return events


def step_breakdown(events: list[dict[str, Any]], batch: int) -> dict[str, Any]:
    """Per pure-decode step of `batch` requests: wall time, top-level GEMM time, and the ops
    (by name) that take the rest."""
    steps = [e for e in events if (m := DECODE_STEP.match(e.get("name", "")))
             and int(m.group(1)) == batch]
    by_thread: dict[tuple[Any, Any], list[dict[str, Any]]] = {}
    for e in events:
        if e.get("cat") == "cpu_op":
            by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    step_ms, gemm_ms, op_ms = [], [], {}
    for s in steps:
        t0, t1 = s["ts"], s["ts"] + s["dur"]
        inside = sorted((e for e in by_thread.get((s.get("pid"), s.get("tid")), [])
                         if t0 <= e["ts"] and e["ts"] + e["dur"] <= t1), key=lambda e: e["ts"])
        gemm, covered_to = 0.0, -1.0
        for e in inside:
            if is_gemm(e["name"]) and e["ts"] >= covered_to:  # top-level: not inside the last
                gemm += e["dur"]
                covered_to = e["ts"] + e["dur"]
            op_ms[e["name"]] = op_ms.get(e["name"], 0.0) + e["dur"] / 1000 / len(steps)
        step_ms.append(s["dur"] / 1000)
        gemm_ms.append(gemm / 1000)
    if not steps:
        names = sorted({e.get("name", "") for e in events if "execute" in e.get("name", "")})
        return {"batch": batch, "steps": 0, "step_names_seen": names[:10]}
    step, gemm = statistics.median(step_ms), statistics.median(gemm_ms)
    top = sorted(op_ms.items(), key=lambda kv: -kv[1])[:15]
    return {"batch": batch, "steps": len(steps), "step_ms_median": step,
            "gemm_ms_median": gemm, "step_over_gemm": step / gemm if gemm else None,
            "within_1_2x_of_gemm": bool(gemm) and step <= 1.2 * gemm,
            "gemm_op_names": sorted({n for n in op_ms if is_gemm(n)}),
            "ops_inclusive_ms_per_step": dict(top)}


async def profiled_batch(url: str, prompts: list[list[int]], steps: int) -> None:
    results: list[Result] = []
    async with httpx.AsyncClient(timeout=600) as client:
        tasks = [asyncio.create_task(stream_completion(client, url, p, steps * 3 + 16,
                                                       sink=results)) for p in prompts]
        deadline = time.monotonic() + 600
        while (len(results) < len(prompts) or any(r.ttft is None for r in results)):
            if time.monotonic() > deadline or all(t.done() for t in tasks):
                break
            await asyncio.sleep(0.02)
        base = [len(r.chunk_times) for r in results]
        (await client.post(url + "/start_profile")).raise_for_status()
        while min(len(r.chunk_times) - b for r, b in zip(results, base)) < steps:
            if all(t.done() for t in tasks) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.02)
        (await client.post(url + "/stop_profile")).raise_for_status()
        await asyncio.gather(*tasks)
    if errors := [r.error for r in results if r.error]:
        raise RuntimeError(f"profiled requests failed: {errors[:2]}")


def profile_decode(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    """Start a float32 vLLM (unified, --vllm-bind), profile `args.profile_steps` decode steps at
    batch `args.concurrency`, stop it; the breakdown, or {"error": ...}."""
    batch = args.concurrency
    trace_dir = Path(tempfile.mkdtemp(prefix="vs_vllm-profile-"))
    cfg = {"profiler": "torch", "torch_profiler_dir": str(trace_dir),
           "torch_profiler_with_stack": False, "ignore_frontend": True}
    group = Group()
    group.add(vllm_serve(args.vllm_python, args.model_path, "float32", free_port(),
                         args.vllm_bind, args.vllm_kv_gib,
                         extra=["--profiler-config", json.dumps(cfg)], name="vllm-profile"))
    try:
        group.wait_ready(args.startup_timeout)
        asyncio.run(closed_loop(group.url, prompts[:batch], 4, batch))
        asyncio.run(profiled_batch(group.url, prompts[:batch], args.profile_steps))
        deadline = time.monotonic() + TRACE_WAIT_S
        while not list(trace_dir.rglob("*.json*")) and time.monotonic() < deadline:
            time.sleep(1)
        time.sleep(2)  # the exporter may still be writing the file it just created
        events = load_events(trace_dir)
    except (RuntimeError, httpx.HTTPError, OSError, ValueError) as e:
        return {"batch": batch, "error": f"{type(e).__name__}: {e}", "logs": group.logs()}
    finally:
        group.stop()
    out = step_breakdown(events, batch)
    out.update(trace_dir=str(trace_dir), logs=group.logs())
    if out.get("step_over_gemm"):
        out["summary"] = (f"step {out['step_ms_median']:.1f} ms, GEMMs {out['gemm_ms_median']:.1f}"
                          f" ms, {out['step_over_gemm']:.2f}x over {out['steps']} steps")
    return out
