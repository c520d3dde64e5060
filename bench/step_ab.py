"""bench/step_vs_gemm.py for two checkouts side by side: a refactor of the engine's step must not
make it slower (issue #46: "no slower than before, side by side in one run").

Runs `bench/step_vs_gemm.py` from each checkout (each with its own PYTHONPATH) in alternating
order, --rounds times, each run in its own process, and writes bench/results/<name>.json (the
runs' medians, every raw value, `lscpu`) and a plot. Times are the script's: this process's
CPU time on one torch thread, so the shared machine's load disturbs them less than the wall clock.

Run: `python bench/step_ab.py --base /work/wt-engine-base --new . [--rounds 3]`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS, bar_groups, figure, save_figure

KEYS = ("engine_step_ms", "forward_ms", "gemm_ms")
# each run's engine step over its own GEMMs: the GEMMs run the same code in both checkouts, so
# this ratio takes out most of what the machine's load did to that run
DERIVED = "engine_step_over_gemm"


def one_run(tree: Path, extra: list[str]) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, PYTHONPATH=str(tree))
        subprocess.run([sys.executable, str(tree / "bench" / "step_vs_gemm.py"), "--out-dir", out,
                        *extra], env=env, check=True, timeout=1800, cwd=tree,
                       stdout=subprocess.DEVNULL)
        data = json.loads((Path(out) / "step_vs_gemm.json").read_text())
    out = {k: data[k] for k in KEYS}
    out[DERIVED] = data["engine_step_ms"] / data["gemm_ms"]
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", type=Path, required=True, help="the checkout before the change")
    ap.add_argument("--new", type=Path, default=Path("."), help="the checkout after it")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--name", default="step_ab")
    ap.add_argument("--iters", type=int, default=3)
    args = ap.parse_args(argv)
    trees = {"before": args.base.resolve(), "after": args.new.resolve()}
    commits = {k: subprocess.run(["git", "-C", str(t), "rev-parse", "--short", "HEAD"],
                                 capture_output=True, text=True).stdout.strip()
               for k, t in trees.items()}
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in trees}
    for rnd in range(args.rounds):
        order = list(trees) if rnd % 2 == 0 else list(trees)[::-1]
        for k in order:
            runs[k].append(one_run(trees[k], ["--iters", str(args.iters)]))
            print(k, runs[k][-1], flush=True)
    med = {k: {key: statistics.median(r[key] for r in rs) for key in (*KEYS, DERIVED)}
           for k, rs in runs.items()}
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    data = {"name": args.name, "commits": commits, "rounds": args.rounds, "iters": args.iters,
            "median": med, "runs": runs,
            "after_over_before": {key: med["after"][key] / med["before"][key]
                                  for key in (*KEYS, DERIVED)},
            "loadavg_end": os.getloadavg(), "lscpu": lscpu}
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{args.name}.json"
    path.write_text(json.dumps(data, indent=1))
    fig, (ax,) = figure(1, 7.0)
    bar_groups(ax, list(KEYS), {f"{k} ({commits[k]})": [med[k][key] for key in KEYS]
                                for k in trees},
               "ms per decode step (CPU time, 1 thread)",
               f"step_vs_gemm before/after, median of {args.rounds} runs each",
               errors={f"{k} ({commits[k]})": [(min(r[key] for r in runs[k]),
                                                max(r[key] for r in runs[k])) for key in KEYS]
                       for k in trees})
    save_figure(fig, args.name)
    for key in (*KEYS, DERIVED):
        print(f"{key:16s} before {med['before'][key]:7.2f}  after {med['after'][key]:7.2f}  "
              f"({data['after_over_before'][key]:.3f}x)")
    print("->", path)
    return data


if __name__ == "__main__":
    main()
