"""Decode TPOT and peak memory of a model served by this tree against `--before TREE` (e.g. a
checkout of main), side by side: s11 made a float32 model read its float32 pool in place
instead of through the decode K/V view (engine/model/decode_view.py), and main still keeps the
view, so the pair measures that change on any model (`--model`, default the packaged GGUF
de-quantized to float32).

Per server: decode TPOT at batch 1 and 8 (B concurrent /generate requests of --prompt tokens,
greedy, ignore_eos, (t(1 + --new tokens) - t(1 token)) / --new, rounds alternating the servers'
order, the median reported and every round kept), and the peak 'resident' memory of the
server's processes while a batch-8 request set decodes (gguf_packed.tree_memory_mib's rule,
sampled every 50 ms before the timed rounds). Load and CPU in the JSON.
Run: `python bench/decode_view.py --before /work/main [--model DIR] [--rounds 5] --suffix _s11`;
JSON + PNG in bench/results/decode_view<suffix>.*.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Run, alternating, bar_groups, figure, load_note, save_figure
from gguf_packed import _timed, peak_memory_mib

NAME = "decode_view"


def _start(tree: str, model: str | None) -> Any:
    """`pdserve serve` running `tree`'s pdcore (first on the server's sys.path)."""
    from pdcore.testing.processes import ServerProcess

    boot = (f"import runpy, sys; sys.path.insert(0, {str(Path(tree).resolve())!r}); "
            "runpy.run_module('pdcore', run_name='__main__', alter_sys=True)")
    flags = ("--max-total-tokens", "8192", *(("--model-path", model) if model else ()))
    return ServerProcess(*flags, command=("-c", boot, "serve"),
                         env={"PDCORE_GGUF_PACKED": "0"}).wait_healthy(900.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, metavar="TREE",
                    help="the tree to compare with (PYTHONPATH), e.g. a checkout of main")
    ap.add_argument("--model", default=None, help="model folder (default: the packaged GGUF)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--suffix", default="")
    args = ap.parse_args()
    if not (Path(args.before) / "pdcore").is_dir():
        ap.error(f"--before {args.before}: no pdcore/ there")
    batches = [int(b) for b in args.batches.split(",")]
    here = str(Path(__file__).resolve().parent.parent)
    trees = {"this tree (pool in place)": here, "before (decode K/V view)": args.before}
    run = Run(NAME + args.suffix, vars(args))
    servers = {}
    out: dict[str, Any] = {"systems": {}}
    samples: dict[str, dict[int, list[float]]] = {}
    try:
        for name, tree in trees.items():
            servers[name] = _start(tree, args.model)
        for name, s in servers.items():
            _timed(s.url, 8, args.prompt, 4)  # warm-up
            out["systems"][name] = {"tree": trees[name], "memory_mib_peak": peak_memory_mib(
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
    a, b0 = (out["systems"][n] for n in trees)
    out["ratios"] = {f"tpot_batch{b}_this_over_before": a["decode"][str(b)]["tpot_ms"]
                     / b0["decode"][str(b)]["tpot_ms"] for b in batches}
    out["ratios"]["peak_this_over_before"] = a["memory_mib_peak"] / b0["memory_mib_peak"]
    out["note"] = load_note(run)
    for name, m in out["systems"].items():
        print(f"{name}: peak {m['memory_mib_peak']:.0f} MiB, " + ", ".join(
            f"batch {b} TPOT {m['decode'][str(b)]['tpot_ms']:.1f} ms" for b in batches),
              flush=True)
    print({k: round(v, 3) for k, v in out["ratios"].items()})
    print(run.finish(out))
    fig, (ax1, ax2) = figure(2, width=5)
    bar_groups(ax1, ["peak resident"], {n: [out["systems"][n]["memory_mib_peak"]] for n in trees},
               "MiB (server's processes)", f"memory ({Path(args.model or 'default').name})")
    bar_groups(ax2, [f"batch {b}" for b in batches],
               {n: [out["systems"][n]["decode"][str(b)]["tpot_ms"] for b in batches]
                for n in trees}, "decode TPOT (ms)", f"TPOT ({out['note']})")
    print(save_figure(fig, NAME + args.suffix))


if __name__ == "__main__":
    main()
