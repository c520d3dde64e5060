"""Does where a weight panel sits in memory change a decode GEMM's speed? (The per-start
hypothesis of #47: heap addresses differ from one server start to the next, so 4 KiB aliasing or
cache-set conflicts would make one start slower.)

In one process, the native panel GEMM (pdcore_native::linear, 8 rows: a decode step at batch 8)
runs over copies of SmolLM2's MLP weights (gate_up [3072, 576], down [576, 1536]) placed at
chosen byte offsets mod 4 KiB and mod 2 MiB, the copies together larger than the caches so each
call streams from memory as a decode step does. Offsets are measured in interleaved rounds (best
of each); the spread across offsets is set against the spread of one offset measured twice.

Run: `python bench/panel_offsets.py [--rounds 5] [--tag T]`; JSON + PNG in
bench/results/panel_offsets[_T].*.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Run, figure, load_note, save_figure

NAME = "panel_offsets"
SHAPES = {"gate_up": (3072, 576), "down": (576, 1536)}
# byte offsets of the panels' start from a 2 MiB boundary: 64-byte steps inside a page, other
# 4 KiB pages, the 2 MiB boundary itself; "0 again" repeats 0 (the noise floor)
OFFSETS = {"0": 0, "64": 64, "1024": 1024, "2048": 2048, "4032": 4032, "+4K": 4096,
           "+64K+64": 65536 + 64, "+1M": 1 << 20, "0 again": 0}
STREAM = 96 << 20  # bytes of weight copies per timed call: past any L3 of this project's hosts
ROWS = 8


def placed(src, offset: int, count: int):
    """`count` copies of the packed weight `src`, each starting `offset` bytes past a 2 MiB
    boundary of its own buffer."""
    import torch

    out = []
    n = src.numel()
    for _ in range(count):
        buf = torch.empty(n + (4 << 20) // 4, dtype=torch.float32)
        base = buf.data_ptr()
        skip = ((-base) % (2 << 20) + offset) // 4
        w = buf[skip:skip + n].view(src.shape)
        w.copy_(src)
        assert (w.data_ptr() - offset) % (2 << 20) == 0
        out.append((buf, w))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tag", default=None)
    a = ap.parse_args()
    import torch

    from pdcore.engine import native
    from pdcore.engine.model.layers import pack_panels

    torch.set_num_threads(a.threads)
    name = f"{NAME}_{a.tag}" if a.tag else NAME
    run = Run(name, vars(a))
    op = native.op("linear")
    if op is None:
        sys.exit(f"native kernels not built: {native.status()}")
    best: dict[str, dict[str, float]] = {s: {o: float("inf") for o in OFFSETS} for s in SHAPES}
    for shape, (n, k) in SHAPES.items():
        panels = pack_panels(torch.randn(n, k))
        x = torch.randn(ROWS, k)
        count = max(2, STREAM // (panels.numel() * 4))
        for _ in range(a.rounds):
            for label, off in OFFSETS.items():  # interleaved: drift hits every offset
                copies = placed(panels, off, count)
                with torch.inference_mode():
                    for _, w in copies[:2]:
                        op(x, w, n, None)
                    t = time.perf_counter()
                    for _, w in copies:
                        op(x, w, n, None)
                    ms = (time.perf_counter() - t) * 1e3 / count
                best[shape][label] = min(best[shape][label], ms)
                del copies
        print(shape + ": " + ", ".join(f"{o} {v:.3f}" for o, v in best[shape].items()),
              flush=True)
    spread = {}
    for shape, v in best.items():
        vals = [t for o, t in v.items() if o != "0 again"]
        spread[shape] = {"range_pct": round((max(vals) - min(vals)) / statistics.median(vals)
                                            * 100, 2),
                         "repeat_pct": round(abs(v["0 again"] / v["0"] - 1) * 100, 2),
                         "gb_s": round(SHAPES[shape][0] * SHAPES[shape][1] * 4
                                       / statistics.median(vals) / 1e6, 1)}
    data = {"best_ms": best, "spread": spread, "note": load_note(run)}
    path = run.finish(data)
    fig, axes = figure(len(SHAPES), width=6)
    for ax, (shape, v) in zip(axes, best.items()):
        ax.bar(list(v), list(v.values()), color="#37a")
        ax.set_ylabel(f"ms per {ROWS}-row GEMM (best of {a.rounds})")
        ax.set_title(f"{shape} {SHAPES[shape]}: offset from 2 MiB\n{data['note']}", fontsize=9)
        ax.tick_params(axis="x", rotation=45)
    save_figure(fig, name)
    print(spread, path)


if __name__ == "__main__":
    main()
