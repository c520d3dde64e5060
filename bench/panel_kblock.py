"""The float32 panel GEMM at prefill sizes (#47): two or more variants (a source tree, each its own
native library built beforehand, and optionally the blocking `pdcore_native::panel_tuning` sets
in it) timed in child processes that alternate, round after round, in one run.

Each child runs one layer's four GEMMs of each model (the 1B-shaped Llama: qkv 2048 -> 3072,
o_proj 2048 -> 2048, gate_up 2048 -> 16384, down 8192 -> 2048; SmolLM2-135M: 576 -> 960,
576 -> 576, 576 -> 3072, 1536 -> 576) at each row count, the weights as pdserve packs them
(pack_panels), and gives each GEMM's median time and GFLOP/s and a hash of every output's bytes:
variants that sum each output in the same order give the same hash, which the parent checks
(the kernel's promise: blocking changes no bit).

Variants: `--variant name=tree` (the tree's defaults) or `name=tree@kblock,block_tiles,group` (the
library's panel_tuning set first; a kblock of 1073741824 runs K whole, the order before). Writes
bench/results/panel_kblock_<tag>.json and .png. Run as a timing run:
`flock -w 3600 /tmp/pd-quiet.lock nice -n -10 python bench/panel_kblock.py
--variant main=/work/main --variant new=/work/wt-x --tag s12`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

NAME = "panel_kblock"
MODELS = {  # name -> [(gemm, N, K)]
    "llama1b": [("qkv", 3072, 2048), ("o_proj", 2048, 2048), ("gate_up", 16384, 2048),
                ("down", 2048, 8192)],
    "smollm2": [("qkv", 960, 576), ("o_proj", 576, 576), ("gate_up", 3072, 576),
                ("down", 576, 1536)],
}


def child(tree: str, tuning: str, runs: list[tuple[str, int]], reps: int) -> dict:
    import torch
    from common import timed

    sys.path.insert(0, tree)  # before the root common.py puts first (this script's tree)
    from pdcore.engine import native
    from pdcore.engine.model.layers import pack_panels

    o = native.ops()
    assert o is not None and native.panel_gemm(), native.status()
    assert native.SOURCE.is_relative_to(Path(tree).resolve()), (native.SOURCE, tree)
    out: dict = {"isa": native.isa(), "threads": torch.get_num_threads(),
                 "source": str(native.SOURCE)}
    if tuning:
        kb, bt, gr = (int(v) for v in tuning.split(","))
        out["tuning"] = list(o.panel_tuning(kb, bt, gr))
    elif hasattr(o, "panel_tuning"):
        out["tuning"] = list(o.panel_tuning(0, 0, 0))
    digest = hashlib.sha256()
    with torch.inference_mode():
        for model, rows in runs:
            g = torch.Generator().manual_seed(1)
            total_s = total_f = 0.0
            for gemm, n, k in MODELS[model]:
                w = torch.randn(n, k, generator=g) / k**0.5
                x = torch.randn(rows, k, generator=g)
                p = pack_panels(w)
                del w
                digest.update(o.linear(x, p, n, None).numpy().tobytes())
                s = timed(lambda: o.linear(x, p, n, None), reps)
                f = 2 * rows * n * k
                out[f"{model}_M{rows}_{gemm}_ms"] = 1e3 * s
                out[f"{model}_M{rows}_{gemm}_gflops"] = f / s / 1e9
                total_s, total_f = total_s + s, total_f + f
            out[f"{model}_M{rows}_layer_ms"] = 1e3 * total_s
            out[f"{model}_M{rows}_layer_gflops"] = total_f / total_s / 1e9
    out["digest"] = digest.hexdigest()[:16]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variant", action="append", default=[],
                    help="name=tree or name=tree@kblock,block_tiles,group (two or more)")
    ap.add_argument("--runs", default="llama1b:512,llama1b:2048,llama1b:8192,smollm2:2048",
                    help="model:rows, comma-separated")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tag", default="")
    ap.add_argument("--isa", default="", help="PDCORE_NATIVE_ISA for the children")
    ap.add_argument("--child", default="", help="(internal) tree[@tuning] to time")
    a = ap.parse_args()
    runs = [(m, int(r)) for m, r in (x.split(":") for x in a.runs.split(","))]
    if any(m not in MODELS for m, _ in runs):
        ap.error(f"--runs: models are {', '.join(MODELS)}")
    if a.child:
        tree, _, tuning = a.child.partition("@")
        print(json.dumps(child(tree, tuning, runs, a.reps)))
        return
    from common import Run, figure, load_note

    variants = dict(v.split("=", 1) for v in a.variant)
    if len(variants) < 2:
        ap.error("give two or more --variant name=tree[@kblock,block_tiles,group]")
    run = Run(NAME + (f"_{a.tag}" if a.tag else ""), vars(a))
    rows: dict[str, list[dict]] = {k: [] for k in variants}
    env0 = {**os.environ, **({"PDCORE_NATIVE_ISA": a.isa} if a.isa else {})}
    names = list(variants)
    for r in range(a.rounds):
        order = names[r % len(names):] + names[:r % len(names)]  # each leads one round in turn
        for name in order:
            tree = variants[name].partition("@")[0]
            p = subprocess.run([sys.executable, __file__, "--child", variants[name], "--reps",
                                str(a.reps), "--runs", a.runs],
                               env={**env0, "PYTHONPATH": tree}, capture_output=True,
                               text=True, timeout=900)
            if p.returncode != 0:
                raise SystemExit(f"panel_kblock: {name} failed:\n{p.stderr[-3000:]}")
            res = json.loads(p.stdout.strip().splitlines()[-1])
            res["loadavg"] = list(os.getloadavg())
            rows[name].append(res)
            print(r, name, {k: round(v, 1) for k, v in res.items()
                            if k.endswith("layer_gflops")}, res["digest"], flush=True)
    keys = [k for k in rows[names[0]][0] if k.endswith(("_ms", "_gflops"))]
    med = {n: {k: statistics.median(x[k] for x in v) for k in keys} for n, v in rows.items()}
    speedup = {n: {k[:-3]: med[names[0]][k] / med[n][k] for k in keys if k.endswith("_ms")}
               for n in names[1:]}
    digests = {n: sorted({x["digest"] for x in v}) for n, v in rows.items()}
    same = len({d for v in digests.values() for d in v}) == 1
    path = run.finish({"variants": variants, "rounds": rows, "median": med,
                       "speedup_over_first": speedup, "digests": digests, "same_bits": same,
                       "note": load_note(run)})
    labels = [f"{m} {g} M{r}" for m, r in runs for g in [*(x[0] for x in MODELS[m]), "layer"]]
    fig, (ax,) = figure(1, width=max(8.0, 0.6 * len(labels)))
    width = 0.8 / len(names)
    for i, n in enumerate(names):
        ax.bar([c + i * width for c in range(len(labels))],
               [med[n][f"{lab.split()[0]}_{lab.split()[2]}_{lab.split()[1]}_gflops"]
                for lab in labels], width, label=n)
    ax.set_xticks([c + 0.4 - width / 2 for c in range(len(labels))], labels, rotation=60,
                  ha="right", fontsize=7)
    ax.set_ylabel("GFLOP/s (median of rounds)")
    ax.set_title(f"float32 panel GEMM, {rows[names[0]][0]['isa']}, "
                 f"{rows[names[0]][0]['threads']} threads")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"))
    print(json.dumps({"median_layer_gflops": {n: {k: round(v, 1) for k, v in m.items()
                                                  if k.endswith("layer_gflops")}
                                              for n, m in med.items()},
                      "speedup_layer": {n: {k: round(v, 3) for k, v in s.items()
                                            if k.endswith("layer")} for n, s in speedup.items()},
                      "same_bits": same}, indent=1), "\n", path)
    if not same:
        raise SystemExit(f"panel_kblock: the variants' outputs differ: {digests}")


if __name__ == "__main__":
    main()
