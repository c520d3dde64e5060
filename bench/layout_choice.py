"""Does the load-time GEMM layout choice follow the host's load? (#47)

Loads SmolLM2 (float32) in a fresh process per trial with PDCORE_GEMM_LAYOUT=auto and counts its
121 GEMM weights in each layout (layers.weight_layouts), for two source trees side by side:
`old` (each layout timed in its own reps, one after the other) and `new` (interleaved pairs).
Three neighbour conditions: none; `busy` (two nice-0 busy loops for the whole trial); `bursty`
(two nice-0 loops that spin BURST_ON_S and sleep BURST_OFF_S, the bursts that can land on one
layout's reps). Trials alternate old / new within each condition. The loading process runs at
nice 0 like a server (--nice 19: like #47's start at nice 19, which the neighbours preempt).

Run (timing: under the quiet lock): `python bench/layout_choice.py --old /work/main --new .
[--model-path /work/smollm2-hf] [--trials 5] [--nice 0] [--tag s8]`; JSON + PNG in
bench/results/layout_choice[_T].*.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Run, figure, load_note, save_figure

NAME = "layout_choice"
CONDITIONS = ("none", "busy", "bursty")
BURST_ON_S, BURST_OFF_S = 0.3, 0.3
TRIAL_TIMEOUT_S = 600
PROBE = """
import json, logging, sys, time
import torch
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s %(message)s")
from pdcore.engine.model.loader import load_model
from pdcore.engine.model.layers import weight_layouts
t = time.perf_counter()
model, _, _ = load_model(sys.argv[1], torch.float32, torch.device("cpu"))
print(json.dumps({"layouts": weight_layouts(model), "load_s": round(time.perf_counter() - t, 2)}))
"""
SPIN = {"busy": "while True: pass",
        "bursty": ("import time\nwhile True:\n t = time.monotonic()\n"
                   f" while time.monotonic() - t < {BURST_ON_S}: pass\n time.sleep({BURST_OFF_S})")}


LOADER_NICE = [0]  # --nice: the loading process's nice (a server started at nice 19: 19)


def _nice0() -> None:
    os.setpriority(os.PRIO_PROCESS, 0, 0)


def _loader_nice() -> None:
    os.setpriority(os.PRIO_PROCESS, 0, LOADER_NICE[0])


def trial(tree: str, model_path: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(Path(tree).resolve()), "PDCORE_GEMM_LAYOUT": "auto"}
    r = subprocess.run([sys.executable, "-c", PROBE, model_path], env=env, capture_output=True,
                       text=True, timeout=TRIAL_TIMEOUT_S, preexec_fn=_loader_nice)
    if r.returncode != 0:
        raise RuntimeError(f"load failed ({tree}): {r.stderr[-2000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    out["decisions"] = [ln.split("GEMM layout for ", 1)[1] for ln in r.stderr.splitlines()
                        if "GEMM layout for " in ln]
    out["loadavg"] = os.getloadavg()[0]
    return out


def run_condition(cond: str, trees: dict[str, str], model_path: str, trials: int) -> dict:
    spinners = []
    try:
        if cond in SPIN:
            spinners = [subprocess.Popen([sys.executable, "-c", SPIN[cond]], preexec_fn=_nice0)
                        for _ in range(2)]
            time.sleep(1.0)
        rows: dict[str, list] = {name: [] for name in trees}
        for i in range(trials):
            for name in (list(trees) if i % 2 == 0 else list(trees)[::-1]):
                rows[name].append(trial(trees[name], model_path))
                print(cond, name, rows[name][-1]["layouts"]["onednn"], "onednn",
                      rows[name][-1]["load_s"], "s", flush=True)
        return rows
    finally:
        for p in spinners:
            p.kill()
            p.wait(timeout=10)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True, help="source tree timed the old way")
    ap.add_argument("--new", required=True, help="source tree timed the new way")
    ap.add_argument("--model-path", default="/work/smollm2-hf")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--conditions", default=",".join(CONDITIONS))
    ap.add_argument("--nice", type=int, default=0, help="the loading process's nice (0..19)")
    ap.add_argument("--tag", default="")
    a = ap.parse_args()
    LOADER_NICE[0] = a.nice
    conds = a.conditions.split(",")
    if any(c not in CONDITIONS for c in conds) or a.trials < 1 or not 0 <= a.nice <= 19:
        print(f"conditions must be among {CONDITIONS}; trials >= 1; nice 0..19", file=sys.stderr)
        return 2
    trees = {"old": a.old, "new": a.new}
    name = NAME + (f"_{a.tag}" if a.tag else "")
    run = Run(name, {"trees": trees, "model": a.model_path, "trials": a.trials,
                     "conditions": conds, "loader_nice": a.nice,
                     "burst_on_off_s": [BURST_ON_S, BURST_OFF_S]})
    results = {c: run_condition(c, trees, a.model_path, a.trials) for c in conds}
    summary = {c: {t: [r["layouts"]["onednn"] for r in rows] for t, rows in res.items()}
               for c, res in results.items()}
    path = run.finish({"onednn_weights_per_trial": summary, "trials": results})
    fig, axes = figure(1, width=7)
    ax = axes[0]
    for j, t in enumerate(trees):
        for k, c in enumerate(conds):
            ys = summary[c][t]
            ax.scatter([k + (j - 0.5) * 0.3] * len(ys), ys, label=t if k == 0 else None,
                       color=f"C{j}")
    ax.set_xticks(range(len(conds)), conds)
    ax.set_ylabel("weights in oneDNN's layout (of 121)")
    ax.set_title(f"SmolLM2 layout choice by neighbour load ({load_note(run)})", fontsize=9)
    ax.legend()
    save_figure(fig, name)
    print(json.dumps(summary), path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
