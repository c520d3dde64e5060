"""Served TPOT with sampling against greedy at batch 8 (#47 item 1: sampled TPOT <= 1.05x
greedy). One unified server (SmolLM2 by default); each round streams 8 concurrent /generate
requests of `--tokens` tokens (ignore_eos) in each mode: greedy (temperature 0), the client's
default (no temperature sent: 1.0) and top-p 0.9, the modes' order rotating from round to round
so a drifting load biases none. The JSON keeps every request's TPOT, each round's load
average, the native sampler's status and the CPU; the plot shows the per-round medians.

Run: `python bench/sampled_tpot.py [--model-path DIR] [--rounds 6] [--tag T]`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Run, figure, load_note, save_figure, start_unified
from grammar_overhead import _stream

NAME = "sampled_tpot"
PROMPT = ("Write a detailed story about a lighthouse keeper who finds a message in a bottle, "
          "with names, places and the weather of each day.")
MODES: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0},
    "client default (t=1)": {},
    "top-p 0.9": {"top_p": 0.9},
}


def one_round(url: str, mode: str, batch: int, tokens: int) -> list[float]:
    body = {"text": PROMPT, "sampling_params": {**MODES[mode], "max_new_tokens": tokens,
                                                "ignore_eos": True}}
    with ThreadPoolExecutor(batch) as pool:
        return [r["tpot_ms"] for r in pool.map(lambda _: _stream(url, body), range(batch))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--tag", default=None, help="results in sampled_tpot_<tag>.json / .png")
    a = ap.parse_args()
    name = f"{NAME}_{a.tag}" if a.tag else NAME
    run = Run(name, vars(a))
    server = start_unified(a.model_path)
    rounds: list[dict[str, Any]] = []
    try:
        one_round(server.url, "greedy", a.batch, 8)  # warm-up
        modes = list(MODES)
        for rnd in range(a.rounds):
            order = modes[rnd % len(modes):] + modes[:rnd % len(modes)]
            got = {m: one_round(server.url, m, a.batch, a.tokens) for m in order}
            rounds.append({"order": order, "loadavg": list(os.getloadavg()), "tpot_ms": got})
            print(f"round {rnd}: " + ", ".join(f"{m} {statistics.median(v):.1f} ms"
                                               for m, v in got.items())
                  + f" (load {os.getloadavg()[0]:.1f})", flush=True)
        import httpx

        stats = httpx.get(server.url + "/metrics", timeout=30).text
    finally:
        server.stop()
    per_round = {m: [statistics.median(r["tpot_ms"][m]) for r in rounds] for m in MODES}
    med = {m: statistics.median(v) for m, v in per_round.items()}
    ratios = {m: [s / g for s, g in zip(per_round[m], per_round["greedy"], strict=True)]
              for m in MODES if m != "greedy"}
    native_line = [line for line in stats.splitlines() if "native_isa" in line and
                   not line.startswith("#")]
    data = {"rounds": rounds, "median_tpot_ms": med, "per_round_median_ms": per_round,
            "sampled_over_greedy": {m: statistics.median(v) for m, v in ratios.items()},
            "sampled_over_greedy_per_round": ratios, "native": native_line,
            "note": load_note(run)}
    path = run.finish(data)
    fig, (ax,) = figure(1, width=7)
    for m, v in per_round.items():
        ax.plot(range(len(v)), v, marker="o", label=f"{m}: median {med[m]:.1f} ms")
    ax.set_xlabel("round (modes alternate)")
    ax.set_ylabel(f"TPOT ms, median of {a.batch} streams")
    ax.set_title(f"batch {a.batch}, {a.tokens} tokens ({load_note(run)})")
    ax.legend()
    save_figure(fig, name)
    print(f"median TPOT {med}; sampled / greedy {data['sampled_over_greedy']}; {path}")


if __name__ == "__main__":
    main()
