"""The W8A8 int8 GEMM's paths side by side (#48: AMX-INT8 where the CPU has it).

Two parts, each path timed in the same process (the GEMMs) or in a child process of its own
(the engine: PDCORE_W8A8_GEMM caps the path the engine picks, logged), the paths alternating:

- gemm: GOPS (2 * M * N * K / s, wall clock, the engine's threads) of
  pdcore_native::int8_linear (the whole layer: per-row quantization, the int32 GEMM, the
  scales) on path 1 (AVX2), 2 (AVX-512 VNNI) and 3 (AMX-INT8), and of torch._int_mm (oneDNN)
  on rows quantized beforehand (the int32 GEMM alone, the torch path's core), at SmolLM2-135M's
  and the 1B model's projection shapes, for M in --rows; median of --iters, each at least
  --min-s long;
- engine (--model-path, a compressed-tensors W8A8 folder): per path, a prefill of --prompt
  tokens (LLMEngine.generate of one prompt, 1 new token: the chunked prefill and the first
  token) and a decode step at --batch sequences (the model's forward with logits over
  consecutive decode batches, step_vs_gemm.decode_steps), medians of --iters.

Run under the quiet lock (preamble): `python bench/amx_int8.py [--model-path /work/smollm2-w8a8]`;
JSON + PNG in bench/results/amx_int8[_TAG].*. A path the CPU lacks is left out and said so.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from common import Run, alternating, figure, load_note, save_figure

NAME = "amx_int8"
PATHS = {1: "avx2", 2: "vnni", 3: "amx"}  # int8_gemm.h's paths (PDCORE_W8A8_GEMM's names)
# (N, K) of each projection: qkv, o, gate_up, down
SHAPES = {"smollm2": {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576),
                      "down": (576, 1536)},
          "1b": {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048),
                 "down": (2048, 8192)}}


def _time(fn: Any, iters: int, min_s: float) -> float:
    """Median seconds of one call (each sample repeats fn until min_s passed)."""
    fn()
    out = []
    for _ in range(iters):
        n, t0 = 0, time.perf_counter()
        while True:
            fn()
            n += 1
            if time.perf_counter() - t0 >= min_s:
                break
        out.append((time.perf_counter() - t0) / n)
    return statistics.median(out)


def gemm_part(rows: list[int], iters: int, min_s: float, paths: list[int]) -> dict[str, Any]:
    from pdcore.engine.model.quant import quantize_rows

    o = torch.ops.pdcore_native
    g = torch.Generator().manual_seed(0)
    out: dict[str, Any] = {}
    for model, shapes in SHAPES.items():
        for kind, (n, k) in shapes.items():
            q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
            packed = o.int8_pack(q, torch.rand(n, generator=g) / 50)
            qt = q.t()
            for m in rows:
                x = torch.randn(m, k, generator=g)
                xq, _ = quantize_rows(x)
                ops = 2.0 * m * n * k
                fns = {PATHS[p]: (lambda p=p: o.int8_linear(x, packed, n, None, p))
                       for p in paths}
                if m > 16:  # _int_mm takes M > 16 only
                    fns["torch_int_mm"] = lambda: torch._int_mm(xq, qt)
                row: dict[str, float] = {}
                for r, name in enumerate(alternating(list(fns), m)):
                    row[name] = ops / _time(fns[name], iters, min_s) / 1e9
                out[f"{model}/{kind}/M{m}"] = {"model": model, "kind": kind, "N": n, "K": k,
                                               "M": m, "gops": row}
                print(f"{model:8s} {kind:8s} M={m:5d} " + "  ".join(
                    f"{p} {row[p]:7.1f}" for p in fns), flush=True)
    return out


CHILD = r"""
import json, statistics, sys, time, torch
sys.path.insert(0, sys.argv[1])
from step_vs_gemm import decode_steps
from pdcore.config import ServerArgs
from pdcore.engine import native
from pdcore.messages.io import SamplingParams
from pdcore.runtime.llm_engine import LLMEngine
model_path, prompt, batch, iters = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
eng = LLMEngine(ServerArgs(model_path=model_path, max_total_tokens=prompt + batch * 256 + 512,
                           disable_radix_cache=True, log_level="warning"))
try:
    model, kv = eng.engine.model, eng.engine.kv
    vocab = eng.engine.hf_config.vocab_size
    ids = [[(37 * j) % 5000 + 100 for j in range(prompt)]]
    sp = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    steps = decode_steps(batch, 96, 8, vocab, True)
    pre, dec = [], []
    with torch.inference_mode():
        for i in range(iters + 1):
            t0 = time.perf_counter(); eng.generate(ids, sp); t1 = time.perf_counter()
            for b in steps:
                model(b, kv.layers, logits=True)
            t2 = time.perf_counter()
            if i:
                pre.append((t1 - t0) * 1e3); dec.append((t2 - t1) * 1e3 / len(steps))
    print(json.dumps({"path": native.INT8_PATHS[native.int8_path()], "prefill_ms": pre,
                      "decode_step_ms": dec}))
finally:
    eng.close()
"""


def engine_part(model_path: str, prompt: int, batch: int, iters: int, rounds: int,
                paths: list[int]) -> dict[str, Any]:
    here = str(Path(__file__).resolve().parent)
    res: dict[str, Any] = {PATHS[p]: {"prefill_ms": [], "decode_step_ms": []} for p in paths}
    for r in range(rounds):
        for name in alternating([PATHS[p] for p in paths], r):
            env = {**os.environ, "PDCORE_W8A8_GEMM": name}
            out = subprocess.run([sys.executable, "-c", CHILD, here, model_path, str(prompt),
                                  str(batch), str(iters)], env=env, capture_output=True,
                                 text=True, timeout=900, check=True)
            got = json.loads(out.stdout.strip().splitlines()[-1])
            assert got["path"] == {"avx2": "avx2", "vnni": "avx512_vnni",
                                   "amx": "amx_int8"}[name], got
            for key in ("prefill_ms", "decode_step_ms"):
                res[name][key] += got[key]
            print(f"round {r} {name}: prefill {statistics.median(got['prefill_ms']):.0f} ms, "
                  f"decode step {statistics.median(got['decode_step_ms']):.2f} ms", flush=True)
    for name in res:
        res[name]["prefill_ms_median"] = statistics.median(res[name]["prefill_ms"])
        res[name]["decode_step_ms_median"] = statistics.median(res[name]["decode_step_ms"])
    return res


def plot(result: dict[str, Any], name: str, rows: list[int]) -> Path:
    models = list(SHAPES) if result.get("gemm") else []
    fig, axes = figure(len(models) + (1 if result.get("engine") else 0), width=5.5)
    for ax, model in zip(axes, models):
        series: dict[str, list[float]] = {}
        for m in rows:
            cells = [v for v in result["gemm"].values() if v["model"] == model and v["M"] == m]
            total = {}
            for c in cells:  # a model's four projections together: total ops / total time
                for p, gops in c["gops"].items():
                    ops = 2.0 * c["M"] * c["N"] * c["K"]
                    total.setdefault(p, [0.0, 0.0])
                    total[p][0] += ops
                    total[p][1] += ops / (gops * 1e9)
            for p, (ops, s) in total.items():
                series.setdefault(p, []).append(ops / s / 1e9 if len(
                    [c for c in cells if p in c["gops"]]) == len(cells) else float("nan"))
        for p, ys in series.items():  # torch._int_mm: no point at M <= 16 (it takes M > 16)
            xs = [i for i, m in enumerate(rows) if p != "torch_int_mm" or m > 16]
            ax.plot(xs, ys, marker="o", label=p)
        ax.set_xticks(range(len(rows)), [str(m) for m in rows])
        ax.set_yscale("log")
        ax.set_xlabel("M (rows)")
        ax.set_ylabel("GOPS (the 4 projections together)")
        ax.set_title(f"{model} int8 GEMM")
        ax.legend(fontsize=8)
    if result.get("engine"):
        ax = axes[-1]
        eng = result["engine"]
        names = list(eng)
        base = eng[names[0]]
        ax.bar([i - 0.2 for i in range(len(names))],
               [base["prefill_ms_median"] / eng[n]["prefill_ms_median"] for n in names], 0.4,
               label="prefill speed (x avx2)")
        ax.bar([i + 0.2 for i in range(len(names))],
               [base["decode_step_ms_median"] / eng[n]["decode_step_ms_median"] for n in names],
               0.4, label="decode step speed (x avx2)")
        ax.set_xticks(range(len(names)), names)
        ax.set_title("W8A8 SmolLM2 engine, per path")
        ax.legend(fontsize=8)
    fig.suptitle(result["note"], fontsize=8)
    return save_figure(fig, name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,8,64,512,4096")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--min-s", type=float, default=0.05)
    ap.add_argument("--model-path", default=None, help="a W8A8 folder: the engine part")
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--engine-iters", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--no-gemm", action="store_true")
    ap.add_argument("--paths", default="1,2,3", help="int8_gemm.h's paths to time (of 1, 2, 3)")
    ap.add_argument("--tag", default=None)
    ap.add_argument("--plot-only", action="store_true", help="redraw the PNG from the JSON")
    a = ap.parse_args()
    name = f"{NAME}_{a.tag}" if a.tag else NAME
    if a.plot_only:
        from common import RESULTS

        saved = json.loads((RESULTS / f"{name}.json").read_text())
        print(plot(saved, name, [int(r) for r in saved["config"]["rows"].split(",")]))
        return
    from pdcore.engine import native

    o = native.ops()
    if o is None:
        raise SystemExit(f"native kernels unavailable: {native.status()}")
    best = int(o.int8_best_path())
    paths = [p for p in PATHS if p <= best and str(p) in a.paths.split(",")]
    run = Run(name, vars(a))
    rows = [int(r) for r in a.rows.split(",")]
    result: dict[str, Any] = {"paths": [PATHS[p] for p in paths],
                              "left_out": {PATHS[p]: (o.int8_amx_why() if p == 3 else "no VNNI")
                                           for p in PATHS if p > best},
                              "threads": torch.get_num_threads(), "uptime_start":
                              os.getloadavg()}
    if not a.no_gemm:
        result["gemm"] = gemm_part(rows, a.iters, a.min_s, paths)
    if a.model_path:
        result["engine"] = engine_part(a.model_path, a.prompt, a.batch, a.engine_iters,
                                       a.rounds, paths)
    result["note"] = load_note(run)
    path = run.finish(result)
    print(plot(result, name, rows))
    print(path, result["note"])


if __name__ == "__main__":
    main()
