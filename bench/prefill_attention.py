"""Prefill attention: the native causal kernel (engine/native: prefill_attention_paged) against
torch's SDPA, the path the engine took before it (#47).

Two parts (`--parts`, both by default):
- `kernel`: one layer's attention of a prompt of n tokens for SmolLM2-135M's heads (3 KV heads
  x 3 query heads of 64), the K/V in a paged float32 pool at scattered slots: `native` reads
  the pool in place; `sdpa` is the engine's former whole-prompt path (the chunk's own K/V, no
  gather, SDPA's causal flash kernel with enable_gqa). Also a chunk of n after a prefix of n
  (`chunk`: the former path gathered the prefix and ran two flash passes, `_after_prefix`).
  Wall clock, median of `--reps`, with 1 and 2 torch threads; GFLOP/s counts the causal half
  (4 * H * d * n(n+1)/2 for a whole prompt).
- `engine`: SmolLM2 (the default model) end to end in this process (LLMEngine): the prefill of
  one prompt of each length (fresh tokens every run: no prefix-cache hit), with the native
  prefill attention on and off (its op hidden from llama.py), runs alternating; the engine's
  native_prefill_chunks counter proves which path ran.

Writes bench/results/prefill_attention.json. Run it as a timing run:
`flock -w 3600 /tmp/pd-quiet.lock nice -n -10 python bench/prefill_attention.py`.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.nn.functional as F
from common import Run, load_note, prefill_timer, timed

NAME = "prefill_attention"
KVH, G, D = 3, 3, 64  # SmolLM2-135M


def kernel_part(lengths: list[int], threads: list[int], reps: int) -> list[dict[str, Any]]:
    from pdcore.engine import native
    from pdcore.engine.model.llama import _after_prefix

    o = native.ops()
    if o is None:
        raise SystemExit(f"native kernels unavailable: {native.status()}")
    g = torch.Generator().manual_seed(0)
    h, scale, rows = KVH * G, D**-0.5, []
    for th in threads:
        torch.set_num_threads(th)
        for n in lengths:
            for case in ("whole", "chunk"):
                ctx = n if case == "whole" else 2 * n
                page = 16
                pages = ctx // page + 4
                kp = torch.randn(pages, page, KVH, D, generator=g)
                vp = torch.randn(pages, page, KVH, D, generator=g)
                kf, vf = kp.view(-1, KVH, D), vp.view(-1, KVH, D)
                slots = torch.randperm(pages * page, generator=g)[:ctx]
                q = torch.randn(n, h, D, generator=g)
                kc, vc = kf[slots[ctx - n:]].transpose(0, 1), vf[slots[ctx - n:]].transpose(0, 1)

                def nat() -> torch.Tensor:
                    return o.prefill_attention_paged(q, kp, vp, slots, scale, 1.0, 1.0, KVH)

                if case == "whole":
                    def ref() -> torch.Tensor:
                        return F.scaled_dot_product_attention(
                            q.transpose(0, 1)[None], kc[None], vc[None], is_causal=True,
                            scale=scale, enable_gqa=True)
                else:
                    def ref() -> torch.Tensor:
                        pre = slots[: ctx - n]
                        kpre = kf.index_select(0, pre).transpose(0, 1)
                        vpre = vf.index_select(0, pre).transpose(0, 1)
                        return _after_prefix(q.transpose(0, 1), kpre.repeat_interleave(G, 0),
                                             vpre.repeat_interleave(G, 0),
                                             kc.repeat_interleave(G, 0),
                                             vc.repeat_interleave(G, 0), scale)
                want = ref()
                want = want[0] if want.dim() == 4 else want
                err = (nat().transpose(0, 1) - want).abs().max().item()
                r = max(1, reps if n <= 2048 else reps // 2)
                tn, ts = timed(nat, r), timed(ref, r)
                pairs = n * (n + 1) / 2 + (ctx - n) * n  # (query, key) pairs computed
                flops = 4 * h * D * pairs
                row = {"threads": th, "case": case, "n": n, "ctx": ctx, "native_ms": tn * 1e3,
                       "sdpa_ms": ts * 1e3, "speedup": ts / tn,
                       "native_gflops": flops / tn / 1e9, "sdpa_gflops": flops / ts / 1e9,
                       "max_abs_diff": err}
                rows.append(row)
                print(f"  t={th} {case:5s} n={n:5d} ctx={ctx:5d}: native {tn * 1e3:8.2f} ms "
                      f"({row['native_gflops']:.0f} GF/s), sdpa {ts * 1e3:8.2f} ms "
                      f"({row['sdpa_gflops']:.0f} GF/s), x{ts / tn:.2f}, diff {err:.1e}",
                      flush=True)
    return rows


def engine_part(lengths: list[int], rounds: int, threads: int) -> list[dict[str, Any]]:
    from pdcore.config import ServerArgs
    from pdcore.engine.model import llama
    from pdcore.runtime.llm_engine import LLMEngine

    torch.set_num_threads(threads)
    rng = random.Random(0)
    eng = LLMEngine(ServerArgs(model_path=None, max_total_tokens=max(lengths) + 2048,
                               log_level="warning"))
    model = eng.loop.runner.model
    rows = []
    prefill = prefill_timer(eng, rng)

    real = llama._native_op

    def switch(on: bool) -> None:  # this process's model: the kernel's op or none
        llama._native_op = real if on else (
            lambda name: None if name == "prefill_attention_paged" else real(name))

    try:
        prefill(64)
        for rnd in range(rounds):
            for n in lengths:
                for on in ((True, False) if rnd % 2 == 0 else (False, True)):
                    switch(on)
                    before = getattr(model, "native_prefill_chunks", None)
                    t = prefill(n)
                    after = getattr(model, "native_prefill_chunks", None)
                    took = None if before is None else after - before
                    rows.append({"round": rnd, "n": n, "native": on, "s": t,
                                 "native_chunks": took})
                    print(f"  round {rnd} n={n:5d} native={int(on)}: {t:.3f} s "
                          f"(native chunks {took})", flush=True)
    finally:
        switch(True)
        eng.close()
    summary = []
    for n in lengths:
        on = statistics.median(r["s"] for r in rows if r["n"] == n and r["native"])
        off = statistics.median(r["s"] for r in rows if r["n"] == n and not r["native"])
        summary.append({"n": n, "native_s": on, "sdpa_s": off, "speedup": off / on})
        print(f"  prefill n={n}: native {on:.3f} s, sdpa {off:.3f} s, x{off / on:.3f}")
    return rows + [{"summary": summary}]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", default="kernel,engine")
    ap.add_argument("--lengths", default="512,2048,4096")
    ap.add_argument("--threads", default="1,2", help="kernel part: torch thread counts")
    ap.add_argument("--engine-threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2, help="engine part: on/off rounds")
    ap.add_argument("--out", default="", help="result folder (default bench/results)")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    parts = args.parts.split(",")
    run = Run(NAME, vars(args))
    data: dict[str, Any] = {}
    if "kernel" in parts:
        data["kernel"] = kernel_part(lengths, [int(x) for x in args.threads.split(",")],
                                     args.reps)
    if "engine" in parts:
        data["engine"] = engine_part(lengths, args.rounds, args.engine_threads)
    data["note"] = load_note(run)
    path = run.finish(data, Path(args.out) if args.out else None)
    print(f"wrote {path} ({data['note']})")


if __name__ == "__main__":
    main()
