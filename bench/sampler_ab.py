"""The cost of sampling one decode step (#47 item 1), side by side in one process: greedy
(argmax, the floor), the native pass (engine/native/sampler.h, where the kernels are built), the
batched torch path it falls back to, and the per-row sampler both replaced
(pdcore/testing/sampling_ref.py), at batch 1 / 8 / 32 over SmolLM2's 49,152-token vocabulary,
for what clients send: no temperature (1.0), the model card's defaults (0.2 / top_p 0.9),
top_p 0.95, top_k 50, penalties. Logits are drawn at three spreads (flat to peaked: a model's
rows are peaked, top-p's cost depends on it). They run in alternation, each timed `--reps`
times; the JSON keeps each one's median and minimum (on a shared machine the minimum is the
cost, the median what the load left) and the machine (CPU flags, load, the native ISA), the
plot shows milliseconds per step.

    python bench/sampler_ab.py [--reps 9] [--threads N]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

from bench.common import Run, bar_groups, figure, load_note, save_figure
from pdcore.engine import native
from pdcore.engine.sched import sampler_native
from pdcore.engine.sched.sampler import SampleState, sample
from pdcore.messages.io import SamplingParams
from pdcore.testing.sampling_ref import reference_sample

VOCAB = 49152
MIXES = {
    "client default (t=1)": dict(temperature=1.0),
    "model card (t=0.2, p=0.9)": dict(temperature=0.2, top_p=0.9),
    "t=1, p=0.95": dict(temperature=1.0, top_p=0.95),
    "t=0.7, k=50": dict(temperature=0.7, top_k=50),
    "t=0.7, p=0.8, penalties": dict(temperature=0.7, top_p=0.8, repetition_penalty=1.1,
                                    frequency_penalty=0.3),
}


def _time(fn, reps: int) -> list[float]:
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1e3)
    return ts


def _torch_path(fn):
    """fn with the native pass switched off (sampler.py's torch path)."""
    def run():
        real = sampler_native.op
        sampler_native.op = lambda: None
        try:
            return fn()
        finally:
            sampler_native.op = real
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--per-row-batches", default="1,8",
                    help="batches that also time the per-row sampler (slow: 150 ms a step at 32)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    native.ops()
    run = Run("sampler_ab", {"reps": a.reps, "vocab": VOCAB, "threads": torch.get_num_threads(),
                             "batches": a.batches, "native": native.status()})
    g = torch.Generator().manual_seed(0)
    rows = []
    for batch in (int(b) for b in a.batches.split(",")):
        for spread in (1.0, 3.0, 8.0):
            logits = torch.randn(batch, VOCAB, generator=g) * spread
            greedy = [SampleState.create(SamplingParams(temperature=0.0), [1])] * batch
            for mix, knobs in MIXES.items():
                params = [SamplingParams(**knobs) for _ in range(batch)]
                states = [SampleState.create(p, list(range(200))) for p in params]
                gens = [None] * batch
                batched = lambda: sample(logits, states, [None] * batch)  # noqa: E731
                fns = {"greedy": lambda: sample(logits, greedy, [None] * batch),
                       "batched (torch)": _torch_path(batched),
                       "per-row (before)": lambda: reference_sample(logits, params, gens)}
                if str(batch) not in a.per_row_batches.split(","):
                    del fns["per-row (before)"]
                if sampler_native.op() is not None:
                    fns = {"native": batched, **fns}
                ts: dict[str, list[float]] = {k: [] for k in fns}
                for rep in range(3):  # alternate the order: a drifting load biases none
                    for name in (list(fns) if rep % 2 == 0 else list(reversed(fns))):
                        ts[name] += _time(fns[name], a.reps)
                med = {k: statistics.median(v) for k, v in ts.items()}
                low = {k: min(v) for k, v in ts.items()}
                best = "native" if "native" in med else "batched (torch)"
                rows.append({"batch": batch, "spread": spread, "mix": mix, "ms": med,
                             "ms_min": low,
                             "speedup": med.get("per-row (before)", math.nan) / med[best],
                             "over_greedy_ms": med[best] - med["greedy"],
                             "over_greedy_ms_min": low[best] - low["greedy"]})
                print(f"B={batch:2d} spread={spread:3.0f} {mix:28s} " + " ".join(
                    f"{k} {med[k]:.2f} ({low[k]:.2f})" for k in fns) + " ms", flush=True)
    path = run.finish({"rows": rows, "note": load_note(run)})
    fig, axes = figure(1, width=12)
    groups = [f"B{r['batch']} s{r['spread']:g}\n{r['mix'][:14]}" for r in rows
              if r["spread"] == 3.0]
    series = {k: [r["ms"].get(k, 0.0) for r in rows if r["spread"] == 3.0]
              for k in rows[0]["ms"]}
    bar_groups(axes[0], groups, series, "ms per step (median)",
               f"sampling cost per decode step, vocab {VOCAB} ({load_note(run)})")
    axes[0].set_yscale("log")
    print(path, save_figure(fig, "sampler_ab"))


if __name__ == "__main__":
    main()
