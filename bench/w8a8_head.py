"""A W8A8 model's lm_head alone, by PDCORE_W8A8_LM_HEAD (#48): the bf16-weight head (`bf16`:
float32 panel GEMM widening bf16 weights, float32 activations) against the bf16 dot-product
head (`bf16_dot`: activations rounded to bf16, vdpbf16ps over pair panels, float32 logits;
AVX-512 BF16 only), optionally the float32 and int8 heads, at --rows (1 and 8: decode batches).

The matrix: the model's lm_head shape (--model-path's config: vocab x hidden, SmolLM2-135M's
49152 x 576 by default), random (the speed does not depend on the values), packed as the loader
packs each head. A decode step streams the head from memory once, so each timing cycles through
copies whose bytes together pass --stream-mb (beyond the last-level cache). The heads alternate
rep by rep (A B, B A); medians over --reps, on the engine's threads (torch's), GB/s of the head's
bytes. Run it under the quiet lock for ratios; the CPU and load are in the JSON.

Run: `python bench/w8a8_head.py [--rows 1,8] [--reps 15] [--heads bf16,bf16_dot] [--tag T]`;
JSON + PNG in bench/results/w8a8_head[_T].*.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from common import Run, alternating, bar_groups, figure, load_note, save_figure

NAME = "w8a8_head"
HEADS = ("float", "int8", "bf16", "bf16_dot")


def _pack(head: str, w: torch.Tensor) -> Any:
    from pdcore.engine.model.layers import pack_panels, pack_panels_bf16
    from pdcore.engine.model.quant import Int8Weight, quantize_weight

    if head == "float":
        return pack_panels(w)
    if head == "bf16":
        return pack_panels(w.bfloat16())
    if head == "bf16_dot":
        return pack_panels_bf16(w.bfloat16())
    return Int8Weight(*quantize_weight(w))


def _bytes(p: Any) -> int:
    ts = p.tensors() if hasattr(p, "tensors") else [p]
    return sum(t.numel() * t.element_size() for t in ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", default="/work/smollm2-w8a8",
                    help="a folder whose config.json gives the head's shape")
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--heads", default="bf16,bf16_dot", help=f"of {', '.join(HEADS)}")
    ap.add_argument("--stream-mb", type=float, default=96.0)
    ap.add_argument("--tag", default=None, help="results in w8a8_head_<tag>.json / .png")
    a = ap.parse_args()
    heads = [h.strip() for h in a.heads.split(",") if h.strip()]
    if not heads or any(h not in HEADS for h in heads):
        ap.error(f"--heads: of {', '.join(HEADS)}")  # exit 2
    try:
        rows = [int(r) for r in a.rows.split(",")]
    except ValueError:
        ap.error("--rows: comma-separated integers")
    from pdcore.engine import native
    from pdcore.engine.model.layers import linear, stand_in
    from pdcore.engine.model.loader import bf16_dot_support

    if not native.panel_gemm():
        print(f"no native panel GEMM here: {native.status()}", file=sys.stderr)
        sys.exit(2)
    if "bf16_dot" in heads and (why := bf16_dot_support()):
        print(f"the bf16_dot head does not serve here: {why}", file=sys.stderr)
        sys.exit(2)
    cfg = json.loads((Path(a.model_path) / "config.json").read_text())
    n, k = int(cfg["vocab_size"]), int(cfg["hidden_size"])
    name = f"{NAME}_{a.tag}" if a.tag else NAME
    run = Run(name, {**vars(a), "shape": [n, k], "threads": torch.get_num_threads()})
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g) / 24
    stand = stand_in(w)
    packed: dict[str, list[Any]] = {}
    for h in heads:
        first = _pack(h, w)
        copies = max(1, -(-int(a.stream_mb * 2**20) // _bytes(first)))
        packed[h] = [first] + [_pack(h, w) for _ in range(copies - 1)]
    xs = {r: torch.randn(r, k, generator=g) for r in rows}

    def once(h: str, r: int) -> float:
        t0 = time.perf_counter()
        for p in packed[h]:
            linear(xs[r], stand, None, p)
        return (time.perf_counter() - t0) * 1e3 / len(packed[h])

    samples: dict[str, dict[int, list[float]]] = {h: {r: [] for r in rows} for h in heads}
    with torch.inference_mode():
        for h in heads:
            for r in rows:
                once(h, r)  # warm
        for rep in range(a.reps):
            for r in rows:
                for h in alternating(heads, rep):
                    samples[h][r].append(once(h, r))
    result: dict[str, Any] = {"isa": native.isa(), "heads": {}}
    for h in heads:
        hb = _bytes(packed[h][0])
        result["heads"][h] = {"bytes": hb, "copies": len(packed[h]), **{
            str(r): {"ms": statistics.median(v), "ms_min": min(v), "ms_reps": v,
                     "gb_s": hb / statistics.median(v) / 1e6} for r, v in samples[h].items()}}
    base = heads[0]
    result["ratios_over_" + base] = {
        h: {str(r): statistics.median(b / o for b, o in zip(samples[base][r], samples[h][r]))
            for r in rows} for h in heads[1:]}
    result["note"] = load_note(run)
    path = run.finish(result)
    for h in heads:
        print(f"{h}: " + ", ".join(
            f"{r} rows {result['heads'][h][str(r)]['ms']:.3f} ms "
            f"({result['heads'][h][str(r)]['gb_s']:.0f} GB/s)" for r in rows))
    for h, per in result["ratios_over_" + base].items():
        print(f"{base}/{h} (median of paired reps): " +
              ", ".join(f"{r} rows {v:.2f}x" for r, v in per.items()))
    fig, (ax,) = figure(1, width=6)
    bar_groups(ax, [f"{r} rows" for r in rows],
               {h: [result["heads"][h][str(r)]["ms"] for r in rows] for h in heads},
               "ms per call", f"lm_head {n} x {k} ({result['note']})")
    print(save_figure(fig, name), path)


if __name__ == "__main__":
    main()
