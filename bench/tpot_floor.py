"""How far decode is from the memory floor on this CPU (#31): a decode step reads every weight
once, so TPOT >= weight bytes / read bandwidth.

In one run: (1) read bandwidth with the server's thread count (a sum over a buffer far larger
than the caches, and a GEMV over SmolLM2's lm_head, the largest weight: what a decode step's
reads achieve); (2) the model's weight bytes as the engine holds them; (3) served TPOT of a
unified server at batch 1 and 8 (streamed /generate, ignore_eos, 64 tokens). The ratio
TPOT / floor is how many weight reads a token costs; the CPU is recorded with the result.

Run: `python bench/tpot_floor.py [--model-path DIR] [--tag T]`; JSON + PNG in
bench/results/tpot_floor[_T].*.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Run, figure, load_note, save_figure, start_unified
from grammar_overhead import _stream

NAME = "tpot_floor"


def bandwidth(threads: int, gib: float = 2.0, reps: int = 5) -> dict[str, float]:
    import torch

    torch.set_num_threads(threads)
    buf = torch.ones(int(gib * (1 << 30)) // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        float(buf.sum())
        best = min(best, time.perf_counter() - t)
    w = torch.randn(49152, 576)  # SmolLM2's lm_head: 113 MB
    x = torch.randn(576)
    gemv = float("inf")
    for _ in range(reps * 4):
        t = time.perf_counter()
        torch.mv(w, x)
        gemv = min(gemv, time.perf_counter() - t)
    del buf
    return {"sum_gb_s": gib * (1 << 30) / best / 1e9, "gemv_gb_s": w.numel() * 4 / gemv / 1e9}


def weight_bytes(url: str) -> int:
    import httpx

    info = httpx.get(url + "/get_server_info", timeout=30).json()
    for key in ("weight_bytes", "model_weight_bytes"):
        if key in info:
            return int(info[key])
    return 0


def served_tpot(url: str, batch: int, rounds: int = 2, sampling: str = "greedy") -> float:
    """Median streamed TPOT of `batch` concurrent requests (64 tokens, ignore_eos), `rounds`
    times; `sampling` greedy (temperature 0) or default (none sent: the server's 1.0)."""
    params: dict[str, Any] = {"max_new_tokens": 64, "ignore_eos": True}
    if sampling == "greedy":
        params["temperature"] = 0
    body = {"text": "Tell me a long story about a lighthouse keeper.", "sampling_params": params}
    tpots: list[float] = []
    for _ in range(rounds):
        with ThreadPoolExecutor(batch) as pool:
            tpots += [r["tpot_ms"] for r in pool.map(lambda _: _stream(url, body), range(batch))]
    return statistics.median(tpots)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tag", default=None, help="results in tpot_floor_<tag>.json / .png")
    a = ap.parse_args()
    name = f"{NAME}_{a.tag}" if a.tag else NAME
    run = Run(name, vars(a))
    bw = bandwidth(a.threads)
    server = start_unified(a.model_path)
    try:
        wbytes = weight_bytes(server.url)
        tpot = {b: served_tpot(server.url, b) for b in (1, 8)}
    finally:
        server.stop()
    floor_ms = {k: wbytes / (v * 1e9) * 1e3 for k, v in bw.items()} if wbytes else {}
    data: dict[str, Any] = {"bandwidth_gb_s": bw, "weight_bytes": wbytes,
                            "floor_ms": floor_ms, "tpot_ms": tpot,
                            "tpot_over_floor": {f"batch{b}": t / floor_ms["sum_gb_s"]
                                                for b, t in tpot.items()} if floor_ms else {},
                            "note": load_note(run)}
    path = run.finish(data)
    fig, (ax,) = figure(1, width=7)
    names = ["floor (sum BW)", "floor (GEMV BW)", "TPOT batch 1", "TPOT batch 8"]
    vals = [floor_ms.get("sum_gb_s", 0), floor_ms.get("gemv_gb_s", 0), tpot[1], tpot[8]]
    ax.bar(names, vals, color=["#888", "#aaa", "#3a7", "#37a"])
    ax.set_ylabel("ms per token")
    ax.set_title(f"{wbytes / 1e6:.0f} MB of weights, {bw['sum_gb_s']:.1f} GB/s read")
    save_figure(fig, name)
    print(f"read {bw['sum_gb_s']:.1f} GB/s (GEMV {bw['gemv_gb_s']:.1f}); weights "
          f"{wbytes / 1e6:.0f} MB; floor {floor_ms.get('sum_gb_s', 0):.1f} ms; TPOT batch 1 "
          f"{tpot[1]:.1f} ms, batch 8 {tpot[8]:.1f} ms; {path}")


if __name__ == "__main__":
    main()
