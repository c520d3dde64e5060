"""Prefill-sized float32 GEMMs alone: pdserve's panels against torch's and vLLM's oneDNN.

At prefill shapes (M = 512 and 2048 rows; SmolLM2's fused matrices as both systems run them:
qkv 576 -> 960, o_proj 576 -> 576, gate_up 576 -> 3072, down 1536 -> 576) and at 1 and 2
threads, one layer's four GEMMs back to back through:
- panels: pdserve's native panel GEMM (pdcore_native::linear, engine/native/gemm.h);
- onednn_packed: torch's mkldnn._linear_pointwise over a weight reordered once
  (pdserve's other layout, models/layers.py);
- torch_mm: F.linear over the plain weight (what torch picks: MKL / oneDNN);
- vllm_onednn_mm: vLLM's own `onednn_mm` over `create_onednn_mm`'s prepacked weight (what vLLM
  0.32 CPU runs for a float32 linear), in vLLM's Python (--vllm-python) as a child process.
Each output's largest error against a float64 product is recorded too (float32 work gives
~1e-6 of the output's scale; a bf16 path would give ~1e-3). Wall-clock medians of --iters
passes after a warm-up, methods alternating; GFLOP/s = 2 M N K summed over the four / time.
Also one core's measured AVX-512 FMA peak (12 independent FMA chains), from a small C program
built here when a compiler is present, and the clock it implies at a Zen 4's 32 FLOP/cycle.

Run: `python bench/prefill_gemm.py [--vllm-python /work/venv-vllm/bin/python]`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

NAME = "prefill_gemm"
SHAPES = {"qkv": (960, 576), "o_proj": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}

PEAK_C = r"""
#include <stdio.h>
#include <time.h>
static double now(void){
  struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9;
}
#define FMA(r) "vfmadd231ps %%zmm30,%%zmm31,%%zmm" #r "\n"
int main(void){
  long it=200000000L; double t=now();
  for(long i=0;i<it;i++){ __asm__ volatile(FMA(0) FMA(1) FMA(2) FMA(3) FMA(4) FMA(5) FMA(6)
      FMA(7) FMA(8) FMA(9) FMA(10) FMA(11) ::: "xmm0","xmm1","xmm2","xmm3","xmm4","xmm5",
      "xmm6","xmm7","xmm8","xmm9","xmm10","xmm11"); }
  double gf=it*12*32.0/(now()-t)/1e9;
  printf("{\"fma_gflops_core\": %.1f, \"clock_ghz_at_32_flop_per_cycle\": %.2f}\n",
         gf, gf / 32);
  return 0;}
"""


def peak() -> dict[str, Any]:
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        return {"skipped": "no C compiler"}
    with tempfile.TemporaryDirectory() as d:
        src, exe = Path(d) / "peak.c", Path(d) / "peak"
        src.write_text(PEAK_C)
        subprocess.run([cc, "-O2", str(src), "-o", str(exe)], check=True)
        return json.loads(subprocess.run([str(exe)], check=True, capture_output=True,
                                         text=True).stdout)


def methods(torch: Any, vllm: bool) -> dict[str, Any]:
    """name -> (prepare(weight) -> state, run(x, state) -> y)."""
    import torch.nn.functional as F

    if vllm:
        import vllm._custom_ops as ops

        return {"vllm_onednn_mm": (lambda w: ops.create_onednn_mm(w.t(), 32),
                                   lambda x, h: ops.onednn_mm(h, x, None))}
    from pdcore.engine import native
    from pdcore.engine.model.layers import PACK_ROWS, pack_panels

    out = {"torch_mm": (lambda w: w, lambda x, w: F.linear(x, w)),
           "onednn_packed": (
               lambda w: torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS),
               lambda x, p: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""))}
    if native.panel_gemm():
        lin = native.ops().linear
        out["panels"] = (lambda w: (pack_panels(w), w.shape[0]),
                         lambda x, s: lin(x, s[0], s[1], None))
    return out


def measure(rows: list[int], threads: list[int], iters: int, vllm: bool,
            only: str = "") -> dict[str, Any]:
    import torch

    torch.manual_seed(0)
    weights = {k: torch.randn(n, kk) / kk ** 0.5 for k, (n, kk) in SHAPES.items()}
    ms = methods(torch, vllm)
    if only:
        ms = {m: f for m, f in ms.items() if m in only.split(",")}
    state = {m: {k: prep(w) for k, w in weights.items()} for m, (prep, _) in ms.items()}
    out: dict[str, Any] = {}
    with torch.inference_mode():
        for M in rows:
            xs = {k: torch.randn(M, w.shape[1]) for k, w in weights.items()}
            flop = sum(2 * M * w.shape[0] * w.shape[1] for w in weights.values())
            err = {}
            for m, (_, run) in ms.items():
                e = 0.0
                for k, w in weights.items():
                    ref = xs[k].double() @ w.double().t()
                    y = run(xs[k], state[m][k])
                    e = max(e, ((y.double() - ref).abs().max() / ref.abs().max()).item())
                err[m] = e
            for t in threads:
                torch.set_num_threads(t)
                times: dict[str, list[float]] = {m: [] for m in ms}
                per: dict[str, dict[str, list[float]]] = {m: {k: [] for k in xs} for m in ms}
                for m, (_, run) in ms.items():  # warm-up (oneDNN builds its primitives)
                    for k in xs:
                        run(xs[k], state[m][k])
                for _ in range(iters):
                    for m, (_, run) in ms.items():
                        t_all = time.perf_counter()
                        for k in xs:
                            t0 = time.perf_counter()
                            run(xs[k], state[m][k])
                            per[m][k].append(time.perf_counter() - t0)
                        times[m].append(time.perf_counter() - t_all)
                for m in ms:
                    med = statistics.median(times[m])
                    out.setdefault(m, {})[f"M{M}_t{t}"] = {
                        "ms": round(med * 1e3, 3), "gflops": round(flop / med / 1e9, 1),
                        "per_gemm_gflops": {
                            k: round(2 * M * weights[k].shape[0] * weights[k].shape[1]
                                     / statistics.median(v) / 1e9, 1)
                            for k, v in per[m].items()},
                        "max_rel_err": err[m]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="512,2048")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--vllm-python", default="")
    ap.add_argument("--methods", default="", help="only these (comma-separated)")
    ap.add_argument("--tag", default="")
    ap.add_argument("--vllm-worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    rows = [int(r) for r in a.rows.split(",")]
    threads = [int(t) for t in a.threads.split(",")]
    if a.vllm_worker:
        print(json.dumps(measure(rows, threads, a.iters, vllm=True)))
        return
    from common import Run

    run = Run(NAME + (f"_{a.tag}" if a.tag else ""), vars(a))
    res = {"peak": peak(), "gemm": measure(rows, threads, a.iters, vllm=False, only=a.methods)}
    if a.vllm_python and (not a.methods or "vllm_onednn_mm" in a.methods):
        p = subprocess.run([a.vllm_python, __file__, "--vllm-worker", "--rows", a.rows,
                            "--threads", a.threads, "--iters", str(a.iters)],
                           capture_output=True, text=True, check=True)
        res["gemm"].update(json.loads(p.stdout.strip().splitlines()[-1]))
    for m, r in res["gemm"].items():
        print(m, {k: (v["gflops"], f"{v['max_rel_err']:.1e}") for k, v in r.items()})
    print("peak", res["peak"])
    print(run.finish(res))


if __name__ == "__main__":
    main()
