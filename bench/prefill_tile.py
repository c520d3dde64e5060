"""The causal prefill attention kernel (prefill_attention_paged) at the 1B-shaped model's heads
(8 KV heads x 4 queries of 64) in a 16k prompt (#47): two or more source trees (each its own
native library, built beforehand) timed in child processes that alternate, round after round,
in one run, so a register tile can be compared with another side by side.

Each child times one layer's call for a chunk of `--chunk` queries at the end of a context of
each of `--ctx` tokens (the pool float32, the slots scattered), median of `--reps`, and gives the
GFLOP/s (the causal half: 4 H d per visible (query, key) pair) and a hash of the output's bytes:
trees that sum in the same order (attn_block.h) give the same hash, which the parent checks.

Writes bench/results/prefill_tile_<tag>.json and .png. Run as a timing run:
`flock -w 3600 /tmp/pd-quiet.lock nice -n -10 python bench/prefill_tile.py --tree base=/work/main
--tree new=/work/wt-x --tag s10`.
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

NAME = "prefill_tile"
KVH, G, D = 8, 4, 64  # Llama-3.2-1B's attention


def child(tree: str, chunk: int, ctxs: list[int], reps: int) -> dict:
    import torch
    from common import timed

    sys.path.insert(0, tree)  # before the root common.py puts first (this script's tree)
    from pdcore.engine import native

    o = native.ops()
    assert o is not None, native.status()
    assert native.SOURCE.is_relative_to(Path(tree).resolve()), (native.SOURCE, tree)
    g = torch.Generator().manual_seed(0)
    slots = max(ctxs) + 256
    kp = torch.randn(slots, KVH, D, generator=g)
    vp = torch.randn(slots, KVH, D, generator=g)
    perm = torch.randperm(slots, generator=g)
    out: dict = {"isa": native.isa(), "threads": torch.get_num_threads(),
                 "source": str(native.SOURCE)}
    digest = hashlib.sha256()
    for ctx in ctxs:
        q = torch.randn(chunk, KVH * G, D, generator=g)
        table = perm[:ctx].clone()
        res = o.prefill_attention_paged(q, kp, vp, table, D**-0.5, 1.0, 1.0, KVH)
        digest.update(res.numpy().tobytes())
        s = timed(lambda: o.prefill_attention_paged(q, kp, vp, table, D**-0.5, 1.0, 1.0, KVH),
                  reps)
        pairs = chunk * (ctx - chunk) + chunk * (chunk + 1) / 2
        out[f"ctx{ctx}_ms"] = 1e3 * s
        out[f"ctx{ctx}_gflops"] = 4 * KVH * G * D * pairs / s / 1e9
    out["digest"] = digest.hexdigest()[:16]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tree", action="append", default=[], help="name=path (two or more)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--ctx", default="2048,8192,16384")
    ap.add_argument("--tag", default="")
    ap.add_argument("--isa", default="", help="PDCORE_NATIVE_ISA for the children")
    ap.add_argument("--child", default="", help="(internal) time the kernel of this tree")
    a = ap.parse_args()
    ctxs = [int(x) for x in a.ctx.split(",")]
    if a.child:
        print(json.dumps(child(a.child, a.chunk, ctxs, a.reps)))
        return
    from common import Run, figure, load_note

    trees = dict(t.split("=", 1) for t in a.tree)
    if not trees:
        raise SystemExit("prefill_tile: give at least one --tree name=path")
    run = Run(NAME + (f"_{a.tag}" if a.tag else ""), vars(a))
    rows: dict[str, list[dict]] = {k: [] for k in trees}
    env0 = {**os.environ, **({"PDCORE_NATIVE_ISA": a.isa} if a.isa else {})}
    for r in range(a.rounds):
        for name in (list(trees) if r % 2 == 0 else list(reversed(trees))):
            p = subprocess.run([sys.executable, __file__, "--child", trees[name], "--reps",
                                str(a.reps), "--chunk", str(a.chunk), "--ctx", a.ctx],
                               env={**env0, "PYTHONPATH": trees[name]}, capture_output=True,
                               text=True, timeout=900, check=True)
            res = json.loads(p.stdout.strip().splitlines()[-1])
            res["loadavg"] = list(os.getloadavg())
            rows[name].append(res)
            print(r, name, json.dumps(res), flush=True)
    keys = [k for k in rows[next(iter(trees))][0] if k.endswith(("_ms", "_gflops"))]
    med = {n: {k: statistics.median(x[k] for x in v) for k in keys} for n, v in rows.items()}
    names = list(trees)
    ratios = {n: {k: med[names[0]][k] / med[n][k] for k in keys if k.endswith("_ms")}
              for n in names[1:]}
    digests = {n: sorted({x["digest"] for x in v}) for n, v in rows.items()}
    same = len({d for v in digests.values() for d in v}) == 1
    path = run.finish({"rounds": rows, "median": med, "speedup_over_first": ratios,
                       "digests": digests, "same_bits": same, "note": load_note(run)})
    fig, (ax,) = figure(1)
    width = 0.8 / len(names)
    for i, n in enumerate(names):
        ax.bar([c + i * width for c in range(len(ctxs))],
               [med[n][f"ctx{c}_gflops"] for c in ctxs], width, label=n)
    ax.set_xticks([c + 0.4 - width / 2 for c in range(len(ctxs))], [str(c) for c in ctxs])
    ax.set_xlabel(f"context (a chunk of {a.chunk} at its end)")
    ax.set_ylabel("GFLOP/s (causal half)")
    ax.set_title(f"prefill attention, 1B heads, {rows[names[0]][0]['isa']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"))
    print(json.dumps({"median": med, "speedup": ratios, "same_bits": same}, indent=1), "\n",
          path)
    if not same:
        raise SystemExit(f"prefill_tile: the trees' outputs differ: {digests}")


if __name__ == "__main__":
    main()
