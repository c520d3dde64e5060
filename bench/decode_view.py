"""Decode TPOT and peak memory of a float32 model served with the decode K/V view (the default
for float32 weights) against the same server reading its float32 pool in place
(PDCORE_DECODE_KV_VIEW_MB=0: the paged kernel, attend_heads), side by side (`--model`, default
the packaged GGUF de-quantized to float32). s11 took the view away from GGUF models served
packed (DecodeKV.prefer_pool, engine/model/decode_view.py), where it measured slower; this is
the check that float32 models should keep it.

Per server: decode TPOT at batch 1 and 8 (B concurrent /generate requests of --prompt tokens,
greedy, ignore_eos, (t(1 + --new tokens) - t(1 token)) / --new, rounds alternating the servers'
order, the median reported and every round kept), and the peak 'resident' memory of the
server's processes while a batch-8 request set decodes (gguf_packed.tree_memory_mib's rule,
sampled every 50 ms before the timed rounds). Load and CPU in the JSON.
Run: `python bench/decode_view.py [--model DIR] [--rounds 5] --suffix _s11`; JSON + PNG in
bench/results/decode_view<suffix>.*.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Run, alternating, bar_groups, figure, load_note, save_figure, start_unified
from gguf_packed import _timed, peak_memory_mib

NAME = "decode_view"
SYSTEMS = {"decode K/V view": {"PDCORE_GGUF_PACKED": "0"},
           "pool in place": {"PDCORE_GGUF_PACKED": "0", "PDCORE_DECODE_KV_VIEW_MB": "0"}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model folder (default: the packaged GGUF)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--suffix", default="")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    run = Run(NAME + args.suffix, vars(args))
    servers = {}
    out: dict[str, Any] = {"systems": {}}
    samples: dict[str, dict[int, list[float]]] = {}
    try:
        for name, env in SYSTEMS.items():
            servers[name] = start_unified(args.model, ("--max-total-tokens", "8192"), env=env,
                                          timeout=900.0)
        for name, s in servers.items():
            _timed(s.url, 8, args.prompt, 4)  # warm-up
            out["systems"][name] = {"env": SYSTEMS[name], "memory_mib_peak": peak_memory_mib(
                s.proc.pid, s.url, args.prompt, 1 + args.new)}
        for r in range(args.rounds):
            for name in alternating(list(servers), r):
                for b in batches:
                    short = _timed(servers[name].url, b, args.prompt, 1)
                    long = _timed(servers[name].url, b, args.prompt, 1 + args.new)
                    samples.setdefault(name, {}).setdefault(b, []).append(
                        max(long - short, 1e-9) / args.new)
    finally:
        for s in servers.values():
            s.stop()
    for name, per in samples.items():
        out["systems"][name]["decode"] = {
            str(b): {"tpot_ms": 1e3 * statistics.median(v),
                     "tpot_ms_rounds": [1e3 * x for x in v]} for b, v in per.items()}
    a, b0 = (out["systems"][n] for n in ("pool in place", "decode K/V view"))
    out["ratios"] = {f"tpot_batch{b}_in_place_over_view": a["decode"][str(b)]["tpot_ms"]
                     / b0["decode"][str(b)]["tpot_ms"] for b in batches}
    out["ratios"]["peak_in_place_over_view"] = a["memory_mib_peak"] / b0["memory_mib_peak"]
    out["note"] = load_note(run)
    for name, m in out["systems"].items():
        print(f"{name}: peak {m['memory_mib_peak']:.0f} MiB, " + ", ".join(
            f"batch {b} TPOT {m['decode'][str(b)]['tpot_ms']:.1f} ms" for b in batches),
              flush=True)
    print({k: round(v, 3) for k, v in out["ratios"].items()})
    print(run.finish(out))
    fig, (ax1, ax2) = figure(2, width=5)
    bar_groups(ax1, ["peak resident"], {n: [out["systems"][n]["memory_mib_peak"]] for n in SYSTEMS},
               "MiB (server's processes)", f"memory ({Path(args.model or 'default').name})")
    bar_groups(ax2, [f"batch {b}" for b in batches],
               {n: [out["systems"][n]["decode"][str(b)]["tpot_ms"] for b in batches]
                for n in SYSTEMS}, "decode TPOT (ms)", f"TPOT ({out['note']})")
    print(save_figure(fig, NAME + args.suffix))


if __name__ == "__main__":
    main()
