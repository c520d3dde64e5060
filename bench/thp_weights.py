"""Decode TPOT with the weights on 2 MiB pages or on 4 KiB pages, side by side in one run.

A float32 decode step streams every weight once (SmolLM2: ~540 MB), so on 4 KiB pages it walks
the page tables some 130,000 times a step; on 2 MiB pages a few hundred. With transparent huge
pages in `madvise` mode (the common default) a torch tensor gets them only when torch's
allocator advises them: THP_MEM_ALLOC_ENABLE=1 (libc10: allocations of 2 MiB or more).

Each round starts one unified server per setting (alternating which goes first), measures
streamed /generate TPOT at batch 1 and 8 (ignore_eos, 64 tokens, greedy and the client default
temperature 1), and reads the server processes' AnonHugePages; the result keeps every raw value,
the medians and the ratio huge / small per case.

Run: `python bench/thp_weights.py [--model-path DIR] [--rounds 3] [--tag T]`; JSON + PNG in
bench/results/thp_weights[_T].*.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Run, _children, bar_groups, figure, load_note, save_figure, start_unified
from tpot_floor import served_tpot

NAME = "thp_weights"
SETTINGS = {"4k": {"THP_MEM_ALLOC_ENABLE": "0"}, "2m": {"THP_MEM_ALLOC_ENABLE": "1"}}


def huge_kib(pid: int) -> int:
    """AnonHugePages of a process tree (the engine runs in a child of the HTTP process)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{p}/smaps_rollup").read_text().splitlines():
                if line.startswith("AnonHugePages:"):
                    total += int(line.split()[1])
        todo += _children(p)
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tag", default=None, help="results in thp_weights_<tag>.json / .png")
    a = ap.parse_args()
    name = f"{NAME}_{a.tag}" if a.tag else NAME
    run = Run(name, vars(a))
    cases = [f"{s}/b{b}" for s in ("greedy", "default") for b in (1, 8)]
    raw: dict[str, dict[str, list[float]]] = {k: {c: [] for c in cases} for k in SETTINGS}
    huge: dict[str, list[int]] = {k: [] for k in SETTINGS}
    for r in range(a.rounds):
        order = list(SETTINGS) if r % 2 == 0 else list(reversed(SETTINGS))
        for key in order:
            server = start_unified(a.model_path, env=SETTINGS[key])
            try:
                served_tpot(server.url, 2, rounds=1)  # warm-up
                huge[key].append(huge_kib(server.proc.pid))
                for c in cases:
                    sampling, b = c.split("/b")
                    raw[key][c].append(served_tpot(server.url, int(b), 1, sampling))
            finally:
                server.stop()
            print(f"round {r} {key}: " + ", ".join(f"{c} {raw[key][c][-1]:.1f} ms"
                                                  for c in cases)
                  + f"; AnonHugePages {huge[key][-1] // 1024} MiB", flush=True)
    med = {k: {c: statistics.median(v) for c, v in raw[k].items()} for k in raw}
    ratio = {c: med["2m"][c] / med["4k"][c] for c in cases}
    data = {"tpot_ms": raw, "median_ms": med, "huge_over_small": ratio,
            "anon_huge_kib": huge, "note": load_note(run)}
    path = run.finish(data)
    fig, (ax,) = figure(1, width=8)
    bar_groups(ax, cases, {k: [med[k][c] for c in cases] for k in SETTINGS},
               "TPOT ms (median)", "weights on 4 KiB vs 2 MiB pages; " + data["note"])
    save_figure(fig, name)
    print("huge / small: " + ", ".join(f"{c} {v:.3f}x" for c, v in ratio.items()) + f"; {path}")


if __name__ == "__main__":
    main()
