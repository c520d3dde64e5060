"""The cost of one attention summation order for every path (#48, native/attn_block.h): two
source trees (each its own native library, built beforehand) timed in child processes that
alternate, round after round, in one run.

Each child times, with the torch threads of this host:
- `decode_*`: the paged decode kernel (decode_attention_paged) for SmolLM2-135M's heads (3 KV
  heads x 3 queries of 64), batch 1 and 8, contexts 512 and 4096 (batch 1 at 4096 takes the
  keys in parts), one layer's call, median of --reps, microseconds;
- `prefill_*`: the causal prefill kernel (prefill_attention_paged), a whole prompt of 512 and
  2048 tokens, one layer, milliseconds;
- `tpot_b1` / `tpot_b8`: the default model (SmolLM2 float32) in LLMEngine in the child: (time to
  generate 65 tokens - time to generate 1) / 64 at batch 1 and 8, prompts of ~100 tokens,
  milliseconds (median of --engine-reps).

Run as a timing run: `flock -w 3600 /tmp/pd-quiet.lock nice -n -10 python bench/attn_orders.py
--tree base=/work/main --tree new=/work/wt-attn --tag s9`; JSON in bench/results/attn_orders_<tag>.json.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))

NAME = "attn_orders"
KVH, G, D = 3, 3, 64


def child(reps: int, engine_reps: int) -> dict:
    import torch
    from common import timed

    # the parent's tree (PYTHONPATH) before the one common.py puts first: this script's own
    tree = os.environ.get("PYTHONPATH", "").split(os.pathsep)[0]
    if tree:
        sys.path.insert(0, tree)
    from pdcore.engine import native

    o = native.ops()
    assert o is not None, native.status()
    g = torch.Generator().manual_seed(0)
    slots = 8192 + 64
    kp = torch.randn(slots // 16, 16, KVH, D, generator=g)
    vp = torch.randn(slots // 16, 16, KVH, D, generator=g)
    out: dict = {"isa": native.isa(), "threads": torch.get_num_threads(),
                 "source": str(native.SOURCE)}
    for b, ctx in ((1, 512), (1, 4096), (8, 512)):
        table = torch.cat([torch.randperm(slots, generator=g)[:ctx] for _ in range(b)])
        q = torch.randn(b, KVH, G, D, generator=g)
        out[f"decode_b{b}_{ctx}_us"] = 1e6 * timed(
            lambda: o.decode_attention_paged(q, kp, vp, table, None, D**-0.5), reps)
    for n in (512, 2048):
        table = torch.randperm(slots, generator=g)[:n]
        q = torch.randn(n, KVH * G, D, generator=g)
        out[f"prefill_{n}_ms"] = 1e3 * timed(
            lambda: o.prefill_attention_paged(q, kp, vp, table, D**-0.5, 1.0, 1.0, KVH),
            max(3, reps // 20))
    if engine_reps:
        from pdcore.config import ServerArgs
        from pdcore.messages.io import SamplingParams
        from pdcore.runtime.llm_engine import LLMEngine

        eng = LLMEngine(ServerArgs(max_total_tokens=16384, page_size=16,
                                   disable_radix_cache=True))
        try:
            for b in (1, 8):
                prompts = [[(17 * i + 31 * j) % 40000 + 100 for j in range(100)]
                           for i in range(b)]

                def gen(n: int) -> float:
                    sp = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
                    t = time.perf_counter()
                    eng.generate(prompts, sp)
                    return time.perf_counter() - t

                gen(4)
                tp = [(gen(65) - gen(1)) / 64 for _ in range(engine_reps)]
                out[f"tpot_b{b}_ms"] = 1e3 * statistics.median(tp)
        finally:
            eng.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tree", action="append", default=[], help="name=path (two or more)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--engine-reps", type=int, default=3)
    ap.add_argument("--tag", default="")
    ap.add_argument("--child", action="store_true")
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.reps, a.engine_reps)))
        return
    from common import Run, load_note

    trees = dict(t.split("=", 1) for t in a.tree)
    run = Run(NAME + (f"_{a.tag}" if a.tag else ""), vars(a))
    rows: dict[str, list[dict]] = {k: [] for k in trees}
    for r in range(a.rounds):
        order = list(trees) if r % 2 == 0 else list(reversed(trees))
        for name in order:
            env = {**os.environ, "PYTHONPATH": trees[name]}
            p = subprocess.run([sys.executable, __file__, "--child", "--reps", str(a.reps),
                                "--engine-reps", str(a.engine_reps)], env=env,
                               capture_output=True, text=True, timeout=900, check=True)
            res = json.loads(p.stdout.strip().splitlines()[-1])
            res["loadavg"] = list(os.getloadavg())
            rows[name].append(res)
            print(r, name, json.dumps(res), flush=True)
    keys = [k for k in rows[next(iter(trees))][0] if k.endswith(("_us", "_ms"))]
    med = {n: {k: statistics.median(x[k] for x in v) for k in keys} for n, v in rows.items()}
    names = list(trees)
    ratios = {k: med[names[1]][k] / med[names[0]][k] for k in keys} if len(names) > 1 else {}
    path = run.finish({"rounds": rows, "median": med, "ratio_second_over_first": ratios,
                       "note": load_note(run)})
    print(json.dumps({"median": med, "ratio": ratios}, indent=1), "\n", path)


if __name__ == "__main__":
    main()
