"""What `--dtype bfloat16` would cost on a CPU without bf16 hardware (#31 item 3), measured on this
one: each setting runs in its own process with PDCORE_CPU_ISA (pdcore/runtime_env.py) capping
torch's and oneDNN's kernels (`avx2`: an AVX2-only CPU such as AMD Zen 2; `native`: this CPU),
and times SmolLM2-135M's linear layers (every GEMM of a decode step: 30 layers of q, k, v, o,
gate, up, down, and the lm_head) in float32 and in bfloat16 at --rows rows (decode batch),
side by side in the same process. The ratio bf16 / float32 is what the refusal message states.

Run: `python bench/bf16_cost.py [--rows 1,8] [--repeats 20]`; JSON + PNG in
bench/results/bf16_cost.*.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Run, figure, save_figure

NAME = "bf16_cost"
HIDDEN, INTER, KV, VOCAB, LAYERS = 576, 1536, 192, 49152, 30
# (out, in) of every linear layer of one SmolLM2 decode step, with how many of each
SHAPES = [((HIDDEN, HIDDEN), 2 * LAYERS), ((KV, HIDDEN), 2 * LAYERS), ((INTER, HIDDEN), 2 * LAYERS),
          ((HIDDEN, INTER), LAYERS), ((VOCAB, HIDDEN), 1)]

CHILD = r"""
import json, sys, time
import torch
from pdcore.runtime_env import forced_isa
rows_list, repeats, shapes = json.loads(sys.argv[1])
torch.manual_seed(0)
out = {"isa": forced_isa() or "native", "capability": torch.backends.cpu.get_cpu_capability(),
       "threads": torch.get_num_threads(), "ms": {}}
for dtype in ("float32", "bfloat16"):
    dt = getattr(torch, dtype)
    ws = [(torch.randn(o, i).to(dt) * 0.02, n) for (o, i), n in shapes]
    for rows in rows_list:
        x = {i: torch.randn(rows, i).to(dt) for i in {w.shape[1] for w, _ in ws}}
        def step():
            for w, n in ws:
                for _ in range(n):
                    torch.nn.functional.linear(x[w.shape[1]], w)
        with torch.inference_mode():
            step()
            best = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter(); step(); best = min(best, time.perf_counter() - t0)
        out["ms"][f"{dtype}/{rows}"] = best * 1000
print(json.dumps(out))
"""


def measure(isa: str, rows: list[int], repeats: int) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "PDCORE_CPU_ISA")}
    if isa != "native":
        env["PDCORE_CPU_ISA"] = isa
    code = "from pdcore.runtime_env import apply; apply()\n" + CHILD
    r = subprocess.run([sys.executable, "-c", code, json.dumps([rows, repeats, SHAPES])],
                       env=env, capture_output=True, text=True, timeout=1800, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--isas", default="avx2,native")
    args = ap.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    run = Run(NAME, vars(args))
    results = {isa: measure(isa, rows, args.repeats) for isa in args.isas.split(",")}
    for isa, res in results.items():
        res["bf16_over_f32"] = {r: res["ms"][f"bfloat16/{r}"] / res["ms"][f"float32/{r}"]
                                for r in rows}
        print(f"{isa:7s} ({res['capability']}): " + ", ".join(
            f"{r} rows: float32 {res['ms'][f'float32/{r}']:.1f} ms, bf16 "
            f"{res['ms'][f'bfloat16/{r}']:.1f} ms ({res['bf16_over_f32'][r]:.2f}x)"
            for r in rows), flush=True)
    data = {"shapes": SHAPES, "results": results}
    path = run.finish(data)
    fig, (a,) = figure(1, 6, 3.8)
    labels = [f"{isa}\n{r} rows" for isa in results for r in rows]
    a.bar(labels, [results[isa]["bf16_over_f32"][r] for isa in results for r in rows])
    a.axhline(1.0, color="k", lw=0.8)
    a.set_ylabel("bf16 / float32 time (one decode step's GEMMs)")
    fig.suptitle(f"{NAME}: SmolLM2 decode-step GEMMs; {run.machine_start.get('cpu', '')}",
                 fontsize=8)
    save_figure(fig, NAME)
    print(f"-> {path}")
    return data


if __name__ == "__main__":
    main()
