"""A decode step against its GEMMs alone: how much of the step is not matrix multiplication.

1. load pdserve's engine (LLMEngine, SmolLM2 by default) with one torch thread;
2. step: end-to-end decode steps of B prompts through the engine (scheduler, packing, model,
   sampling): (T(1 + N new tokens) - T(1 new token)) / N;
3. forward: the model's decode forward alone, --new-tokens consecutive steps of B sequences
   growing from ctx tokens (hand-built batches with request keys, so the decode K/V view of
   pdcore/engine/model/decode_view.py fills on the first step and appends after, as in serving);
   "forward, gather": the same steps without keys (K/V gathered out of the pool in every layer);
4. GEMMs: every linear layer of the model (and the lm head) on B random rows, through the same
   `linear` the model calls (prepacked where the model packs), back to back;
5. torch profiler of the forward: the top ops by self time;
all timed with this process's CPU time (one thread: the cost on a core of its own, which the
shared machine's load disturbs far less than the wall clock), medians over --iters, systems
alternating; written to bench/results/step_vs_gemm.json.

Run: `python bench/step_vs_gemm.py [--batch 8] [--ctx 256] [--dtype float32]`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from common import Run, load_note, ratio
from engine_throughput import PdserveRunner, make_prompts

NAME = "step_vs_gemm"


def gemm_only(model: Any, rows: int) -> Any:
    """A callable running every linear layer of `model` once on `rows` random rows."""
    from pdcore.engine.model.layers import ColumnLinear, RowLinear, linear

    calls = []
    for m in model.modules():
        if isinstance(m, (ColumnLinear, RowLinear)):
            x = torch.randn(rows, m.weight.shape[1],  # a W8A8 layer takes float rows
                            dtype=torch.float32 if m.int8 is not None else m.weight.dtype)
            calls.append((x, m))
    head = model.lm_head
    hx = torch.randn(rows, head.shape[1], dtype=head.dtype)

    @torch.inference_mode()
    def run() -> None:
        for x, m in calls:
            m(x) if isinstance(m, ColumnLinear) or m.int8 is not None \
                else linear(x, m.weight, None, m.packed)
        linear(hx, head, None, getattr(model, "lm_head_packed", None))

    return run


def decode_steps(batch: int, ctx: int, steps: int, vocab: int, keyed: bool) -> list[Any]:
    """`steps` consecutive decode batches: sequence i holds slots [i*M, i*M + ctx + j) at
    step j (M = ctx + steps) and adds its last one."""
    from pdcore.engine.model.batch import ForwardBatch, SeqSpan

    g, m, out = torch.Generator().manual_seed(0), ctx + steps, []
    for j in range(steps):
        n = ctx + j
        seqs = [SeqSpan(i, 1, torch.arange(i * m, i * m + n), key=i if keyed else None)
                for i in range(batch)]
        out.append(ForwardBatch(
            input_ids=torch.randint(100, vocab, (batch,), generator=g),
            positions=torch.full((batch,), n - 1, dtype=torch.long),
            out_slots=torch.tensor([i * m + n - 1 for i in range(batch)]),
            seqs=seqs, logit_rows=torch.arange(batch)))
    return out


def timed(fn: Any) -> float:
    """CPU milliseconds of one call."""
    t0 = time.process_time()
    fn()
    return (time.process_time() - t0) * 1000


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--out-dir", type=Path, default=None)
    ap.add_argument("--no-e2e", action="store_true", help="skip the end-to-end engine steps")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    run = Run(NAME, {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()})
    tokens = args.batch * (max(args.ctx, args.prompt_len) + args.new_tokens + 8)
    pd = PdserveRunner(args.model_path, tokens, args.dtype)
    try:
        model, kv = pd.engine.engine.model, pd.engine.engine.kv
        gemms = gemm_only(model, args.batch)

        steps = max(1, args.new_tokens)

        def forward_steps(keyed: bool) -> Any:
            batches = decode_steps(args.batch, args.ctx, steps, pd.vocab, keyed)

            @torch.inference_mode()
            def run() -> None:
                for b in batches:
                    model(b, kv.layers)

            return run

        forward, gather = forward_steps(True), forward_steps(False)
        for fn in (gemms, forward, gather):
            fn()
        t: dict[str, list[float]] = {"gemm_ms": [], "forward_ms": [], "forward_gather_ms": []}
        per = {"gemm_ms": 1, "forward_ms": steps, "forward_gather_ms": steps}
        for rep in range(args.iters):
            order = [("gemm_ms", gemms), ("forward_ms", forward), ("forward_gather_ms", gather)]
            for key, fn in order if rep % 2 == 0 else order[::-1]:
                t[key].append(timed(fn) / per[key])
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            forward()
        top = [(e.key, e.self_cpu_time_total / 1000.0 / steps, e.count // steps)
               for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:15]]
        e2e = None
        if not args.no_e2e:
            prompts = make_prompts(args.batch, args.prompt_len, pd.vocab, 1)
            pd.generate(prompts, 2)
            t1, tn = [], []
            for _ in range(3):
                t1.append(timed(lambda: pd.generate(prompts, 1)))
                tn.append(timed(lambda: pd.generate(prompts, args.new_tokens + 1)))
            e2e = (statistics.median(tn) - statistics.median(t1)) / args.new_tokens
    finally:
        pd.close()
    gemm, fwd = statistics.median(t["gemm_ms"]), statistics.median(t["forward_ms"])
    fwd_g = statistics.median(t["forward_gather_ms"])
    data = {"gemm_ms": gemm, "forward_ms": fwd, "forward_gather_ms": fwd_g,
            "engine_step_ms": e2e, "raw": t,
            "forward_over_gemm": ratio(fwd, gemm), "forward_gather_over_gemm": ratio(fwd_g, gemm),
            "engine_step_over_gemm": ratio(e2e, gemm) if e2e else None,
            "top_ops": [{"op": k, "ms_per_step": ms, "calls_per_step": n} for k, ms, n in top]}
    path = run.finish(data, args.out_dir)
    print(f"batch {args.batch}, ctx {args.ctx}, {args.dtype}, 1 thread, CPU time")
    print(f"  GEMMs alone  {gemm:7.2f} ms")
    print(f"  forward      {fwd:7.2f} ms  ({data['forward_over_gemm']:.2f}x GEMMs)")
    print(f"  fwd, gather  {fwd_g:7.2f} ms  ({data['forward_gather_over_gemm']:.2f}x GEMMs)")
    if e2e:
        print(f"  engine step  {e2e:7.2f} ms  ({data['engine_step_over_gemm']:.2f}x GEMMs)")
    print("  top ops of the forward (self ms per step, calls per step):")
    for k, ms, n in top:
        print(f"    {k[:48]:48s} {ms:7.2f} {n:5d}")
    print(f"({load_note(run)}) -> {path}")
    return data


if __name__ == "__main__":
    main()
