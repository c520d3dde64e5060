"""Long contexts: decode attention and chunked prefill at 2k, 8k and 32k tokens of context.

Three parts (`--parts`, all by default):
- `attention`: one layer's decode attention, per step, against the context length, for
  SmolLM2-135M's heads (3 KV heads x 3 query heads of 64) and a Llama-3.2-1B's (8 x 4 of 64),
  batch 1 and 4, each way the engine can run it: `gather` (the rows copied out of the pool
  every layer, then the native kernel: the path once the decode K/V view is over its memory
  budget), `gather+sdpa` (batch 1: one sequence outside a decode group: advanced indexing and
  SDPA, the engine's path for a lone decode before the paged kernel), `view` (the kernel on
  the decode K/V view's contiguous buffers, the append not counted) and `paged` (the kernel
  reading the pool in place through the slot table);
- `prefill`: one layer's attention of the last prefill chunk (n queries at the end of a
  context of ctx tokens), as the engine computes it (the context's K/V gathered from the pool,
  a boolean mask, SDPA), for the chunk sizes the scheduler may use;
- `engine`: SmolLM2 (the default model) end to end in one process (LLMEngine): prefill time
  against prompt length for several --chunked-prefill-size values, and the decode step at
  2k / 8k tokens of context, batch 1 and 4 (step = (T(1 + N) - T(1)) / N over greedy runs).

Times are this process's CPU time with one torch thread by default (`--clock wall` for the
wall clock): the cost on a core of one's own, which a loaded machine disturbs far less than
the wall clock. The load is recorded at the start and end of every result; on a shared
machine caches are shared too, so compare variants of one run, not runs.

Writes bench/results/long_context.json and .png. `--quick` runs a smoke-sized version (small
contexts, no engine part) in seconds.

Run: `python bench/long_context.py [--quick] [--parts attention,prefill,engine] [--threads 1]`.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.nn.functional as F
from common import Run, figure, load_note, save_figure

NAME = "long_context"
SHAPES = {  # name: (kv heads, query heads per KV head, head_dim, layers)
    "smollm2-135m": (3, 3, 64, 30),
    "llama-1b-shape": (8, 4, 64, 16),
}
CLOCK: list[Callable[[], float]] = [time.process_time]


def timed(fn: Callable[[], Any], reps: int) -> float:
    """Median seconds of `reps` calls after one warm-up."""
    fn()
    xs = []
    for _ in range(reps):
        t = CLOCK[0]()
        fn()
        xs.append(CLOCK[0]() - t)
    return statistics.median(xs)


def _pool(slots: int, kvh: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(slots, 1, kvh, d, generator=g), torch.randn(slots, 1, kvh, d, generator=g))


def _tables(batch: int, ctx: int, total: int, scattered: bool) -> torch.Tensor:
    """[batch * ctx] slots: each request's own run of slots (what a fresh pool hands out), or
    a random permutation (a pool fragmented by many requests)."""
    if scattered:
        return torch.randperm(total, generator=torch.Generator().manual_seed(1))[: batch * ctx]
    return torch.arange(batch * ctx)


def attention_part(contexts: dict[str, list[int]], batches: list[int], reps: int,
                   scattered: bool) -> list[dict[str, Any]]:
    from pdcore.engine import native

    o = native.ops()
    if o is None:
        raise SystemExit(f"native kernels unavailable: {native.status()}")
    rows = []
    for shape, ctxs in contexts.items():
        kvh, grp, d, _ = SHAPES[shape]
        for batch in batches:
            for ctx in ctxs:
                if batch * ctx > 40000:  # 32k: batch 1 only (the pools of 4 would be GBs)
                    continue
                total = batch * ctx + 64
                kp, vp = _pool(total, kvh, d)
                kf, vf = kp.view(-1, kvh, d), vp.view(-1, kvh, d)
                table = _tables(batch, ctx, total, scattered)
                q = torch.randn(batch, kvh, grp, d)
                scale = d**-0.5
                view_k = kf.index_select(0, table).view(batch, ctx, kvh, d).transpose(1, 2) \
                    .contiguous()
                view_v = vf.index_select(0, table).view(batch, ctx, kvh, d).transpose(1, 2) \
                    .contiguous()

                def gather() -> torch.Tensor:
                    kb = kf.index_select(0, table).view(batch, ctx, kvh, d).transpose(1, 2)
                    vb = vf.index_select(0, table).view(batch, ctx, kvh, d).transpose(1, 2)
                    return o.decode_attention(q, kb, vb, None, scale)

                def gather_sdpa() -> torch.Tensor:  # batch 1 only: the lone decode's old path
                    qi = q.reshape(1, kvh * grp, 1, d)
                    ki, vi = kf[table].transpose(0, 1), vf[table].transpose(0, 1)
                    return F.scaled_dot_product_attention(qi, ki[None], vi[None], scale=scale,
                                                          enable_gqa=True)

                ways = {"gather": gather,
                        "view": lambda: o.decode_attention(q, view_k, view_v, None, scale),
                        "paged": lambda: o.decode_attention_paged(q, kp, vp, table, None, scale)}
                if batch == 1:
                    ways["gather+sdpa"] = gather_sdpa
                ref = ways["view"]()
                assert torch.equal(ways["paged"](), ref) and torch.equal(ways["gather"](), ref)
                row = {"shape": shape, "batch": batch, "ctx": ctx}
                for name, fn in ways.items():
                    row[f"{name}_ms"] = timed(fn, reps) * 1e3
                layers = SHAPES[shape][3]
                row["per_step"] = {k[:-3]: v * layers for k, v in row.items()
                                      if k.endswith("_ms")}
                # the bytes of K and V one step reads per layer, and what paged reaches
                nbytes = 2 * batch * ctx * kvh * d * 4
                row["paged_GBps"] = nbytes / (row["paged_ms"] * 1e-3) / 1e9
                rows.append(row)
                print(f"  {shape} B={batch} ctx={ctx}: " + ", ".join(
                    f"{k[:-3]} {v:.3f} ms" for k, v in row.items() if k.endswith("_ms"))
                    + f" (paged {row['paged_GBps']:.1f} GB/s)", flush=True)
                del kp, vp, kf, vf, view_k, view_v
    return rows


def prefill_part(cases: list[tuple[str, int, int]], reps: int) -> list[dict[str, Any]]:
    """One layer's attention of a prefill chunk of n queries ending a context of ctx tokens,
    as llama.py computes it: the context gathered out of the pool (advanced indexing), a
    boolean mask, SDPA with GQA; and the K/V gather alone (its share)."""
    from pdcore.engine.model.llama import _after_prefix

    rows = []
    for shape, ctx, n in cases:
        kvh, grp, d, layers = SHAPES[shape]
        kp, vp = _pool(ctx + 64, kvh, d)
        kf, vf = kp.view(-1, kvh, d), vp.view(-1, kvh, d)
        slots = torch.arange(ctx)
        q = torch.randn(kvh * grp, n, d)

        def gather() -> tuple[torch.Tensor, torch.Tensor]:
            return kf[slots].transpose(0, 1), vf[slots].transpose(0, 1)

        def step() -> torch.Tensor:
            ki, vi = gather()
            mask = None
            if n < ctx:
                qpos = torch.arange(ctx - n, ctx).unsqueeze(1)
                mask = torch.arange(ctx).unsqueeze(0) <= qpos
            return F.scaled_dot_product_attention(
                q[None], ki[None], vi[None], attn_mask=mask, is_causal=mask is None,
                scale=d**-0.5, enable_gqa=True)

        def split() -> torch.Tensor:  # the engine's path now (llama._after_prefix)
            pre = slots[: ctx - n]
            kq = kf.index_select(0, pre).transpose(0, 1)
            vq = vf.index_select(0, pre).transpose(0, 1)
            kc, vc = kf[ctx - n: ctx].transpose(0, 1), vf[ctx - n: ctx].transpose(0, 1)
            return _after_prefix(q, kq, vq, kc, vc, d**-0.5)

        row = {"shape": shape, "ctx": ctx, "chunk": n, "masked_ms": timed(step, reps) * 1e3,
               "gather_ms": timed(gather, reps) * 1e3}
        if n < ctx:
            err = (split() - step()[0]).abs().max().item()
            row.update(split_ms=timed(split, reps) * 1e3, split_max_abs_diff=err)
        row["masked_per_chunk_s"] = row["masked_ms"] * layers / 1e3
        rows.append(row)
        print(f"  {shape} ctx={ctx} chunk={n}: masked SDPA {row['masked_ms']:.1f} ms/layer "
              f"(its gather {row['gather_ms']:.2f} ms), split "
              f"{row.get('split_ms', float('nan')):.1f} ms/layer", flush=True)
    return rows


def engine_part(lengths: list[int], chunks: list[int], decode: list[tuple[int, int]],
                steps: int) -> dict[str, Any]:
    from pdcore.config import ServerArgs
    from pdcore.messages.io import SamplingParams
    from pdcore.runtime.llm_engine import LLMEngine

    rng = random.Random(0)
    out: dict[str, Any] = {"prefill": [], "decode": []}

    def prompts(b: int, n: int) -> list[list[int]]:
        return [[rng.randrange(100, 40000) for _ in range(n)] for _ in range(b)]

    def run(eng: Any, ps: list[list[int]], new: int) -> float:
        sp = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)
        t = CLOCK[0]()
        eng.generate(ps, sp)
        return CLOCK[0]() - t

    total = max([*lengths, *(c * b for c, b in decode)]) + 1024
    for chunk in chunks:
        eng = LLMEngine(ServerArgs(model_path=None, max_total_tokens=total, log_level="warning",
                                   chunked_prefill_size=chunk))
        try:
            run(eng, prompts(1, 64), 2)
            for n in lengths:
                t = run(eng, prompts(1, n), 1)
                out["prefill"].append({"chunk": chunk, "len": n, "s": t, "tok_s": n / t})
                print(f"  prefill chunk={chunk} len={n}: {t:.2f} s ({n / t:.0f} tok/s)",
                      flush=True)
            if chunk != chunks[0]:
                continue
            for ctx, b in decode:
                # fresh prompts for each run (the same ones would hit the prefix cache)
                t1, tn = run(eng, prompts(b, ctx), 1), run(eng, prompts(b, ctx), 1 + steps)
                step = (tn - t1) / steps
                out["decode"].append({"ctx": ctx, "batch": b, "step_ms": step * 1e3,
                                      "prefill_s": t1})
                print(f"  decode ctx={ctx} B={b}: step {step * 1e3:.1f} ms", flush=True)
        finally:
            eng.close()
    return out


def plot(data: dict[str, Any], name: str = NAME) -> Path:
    fig, axes = figure(3, 5.0, 4.0)
    ax = axes[0]
    for shape in SHAPES:
        for b in sorted({r["batch"] for r in data.get("attention", [])}):
            rs = [r for r in data.get("attention", []) if r["shape"] == shape and r["batch"] == b]
            if not rs:
                continue
            for way, style in (("gather", "--"), ("paged", "-")):
                ax.plot([r["ctx"] for r in rs], [r["per_step"][way] for r in rs], style,
                        marker="o", label=f"{shape} B{b} {way}")
    ax.set(xscale="log", yscale="log", xlabel="context tokens", ylabel="ms per step (all layers)",
           title="decode attention")
    ax.legend(fontsize=6)
    ax = axes[1]
    for shape in SHAPES:
        rs = [r for r in data.get("prefill", []) if r["shape"] == shape]
        for n in sorted({r["chunk"] for r in rs}):
            sel = [r for r in rs if r["chunk"] == n]
            for way, style in (("masked", "--"), ("split", "-")):
                pts = [(r["ctx"], r[f"{way}_ms"]) for r in sel if f"{way}_ms" in r]
                ax.plot([x for x, _ in pts], [y for _, y in pts], style, marker="o",
                        label=f"{shape} chunk {n} {way}")
    ax.set(xscale="log", yscale="log", xlabel="context tokens", ylabel="ms per layer",
           title="last prefill chunk's attention")
    ax.legend(fontsize=6)
    ax = axes[2]
    eng = data.get("engine") or {}
    for chunk in sorted({r["chunk"] for r in eng.get("prefill", [])}):
        sel = [r for r in eng["prefill"] if r["chunk"] == chunk]
        ax.plot([r["len"] for r in sel], [r["tok_s"] for r in sel], marker="o",
                label=f"chunk {chunk}")
    ax.set(xscale="log", xlabel="prompt tokens", ylabel="prefill tok/s (CPU time)",
           title="SmolLM2 prefill")
    ax.legend(fontsize=6)
    return save_figure(fig, name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="attention,prefill,engine")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--scattered", action="store_true",
                    help="decode contexts on randomly permuted slots (a fragmented pool)")
    ap.add_argument("--quick", action="store_true", help="smoke-sized (seconds)")
    ap.add_argument("--name", default=NAME, help="result file name")
    ap.add_argument("--engine-lengths", type=int, nargs="+", default=[512, 2048, 8000])
    ap.add_argument("--engine-chunks", type=int, nargs="+", default=[512, 1024, 2048, 4096],
                    help="--chunked-prefill-size values (the first also runs the decodes)")
    ap.add_argument("--engine-decode", nargs="+", default=["2048x1", "2048x4", "8000x1"],
                    help="decode steps at CTXxBATCH")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.clock == "wall":
        CLOCK[0] = time.perf_counter
    parts = set(args.parts.split(","))
    if args.quick:
        contexts = {"smollm2-135m": [256, 1024], "llama-1b-shape": [1024]}
        batches, reps = [1, 2], 2
        prefill_cases = [("smollm2-135m", 1024, 256)]
        parts.discard("engine")
    else:
        contexts = {"smollm2-135m": [2048, 8192], "llama-1b-shape": [2048, 8192, 32768]}
        batches, reps = [1, 4], args.reps
        prefill_cases = [(s, ctx, n) for s in ("smollm2-135m",) for ctx in (2048, 8192)
                         for n in (512, 1024, 2048) if n <= ctx] + \
            [("llama-1b-shape", 32768, n) for n in (1024, 2048)]
    run = Run(args.name, {**vars(args), "contexts": contexts, "batches": batches,
                     "prefill_cases": prefill_cases})
    data: dict[str, Any] = {}
    if "attention" in parts:
        print("decode attention, one layer:", flush=True)
        data["attention"] = attention_part(contexts, batches, reps, args.scattered)
    if "prefill" in parts:
        print("prefill chunk attention, one layer:", flush=True)
        data["prefill"] = prefill_part(prefill_cases, max(1, reps // 2))
    if "engine" in parts:
        print("engine (SmolLM2):", flush=True)
        data["engine"] = engine_part(args.engine_lengths, args.engine_chunks,
                                     [(int(c), int(b)) for c, b in
                                      (x.split("x") for x in args.engine_decode)], 8)
    data["load"] = load_note(run)
    path = run.finish(data)
    print(f"{data['load']}; wrote {path} and {plot(data, args.name)}")


if __name__ == "__main__":
    main()
