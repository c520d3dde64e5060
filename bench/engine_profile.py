"""Where a pdserve decode step spends its time, against transformers, and a prototype of
batched decode attention (measured here; the engine itself is not changed by this script).

Lifecycle:
1. load pdserve's engine (LLMEngine) and transformers on the same weights, same torch threads;
2. per-step cost from end-to-end generate calls: prefill-only (1 new token) and prefill + N
   decode steps, alternating the systems; step = (T(N+1) - T(1)) / N, prefill = T(1);
3. a decode step of pdserve's model alone (ForwardBatch of B sequences x ctx tokens built by
   hand), with its attention as is (one SDPA per sequence per layer) and with the prototype
   (the B sequences' K/V gathered into one padded [B, KVH, ctx_max, D] tensor, one masked SDPA
   per layer), each also with bfloat16 weights (--bf16), alternating; logits compared;
4. torch profiler of decode steps per variant: share of time per op group (matmul, K/V gather,
   SDPA, K/V write, other = elementwise, norms, rotary, copies);
5. print everything; write bench/results/engine_profile.json.

Run: `python bench/engine_profile.py [--batch 16] [--ctx 256] [--threads 1] [--quick]`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.nn.functional as F
from common import Run, alternating, load_note, ratio
from engine_throughput import PdserveRunner, TransformersRunner, make_prompts

NAME = "engine_profile"
# process CPU time by default: with one torch thread it is the cost on a core of one's own,
# which the shared machine's load disturbs far less than the wall clock (--clock wall)
CLOCK = [time.process_time]
OP_GROUPS = (("matmul", ("aten::mm", "aten::addmm", "aten::bmm")),
             ("kv_gather", ("aten::index",)),
             ("sdpa", ("flash_attention", "aten::_scaled_dot_product", "aten::baddbmm",
                       "aten::_softmax")),
             ("kv_write", ("aten::index_put", "aten::_index_put_impl_")))


# -- the prototype -----------------------------------------------------------------------------
def batched_decode_attention(self: Any, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                             k_cache: torch.Tensor, v_cache: torch.Tensor, batch: Any
                             ) -> torch.Tensor:
    """Attention.forward for a batch where every sequence has one new token: one gather of all
    sequences' K/V into a padded tensor and one masked SDPA, instead of a loop over sequences.
    The padded slot table and mask depend only on the batch: built once, shared by all layers."""
    from pdcore.engine.models.llama import _rotate_half

    T = h.shape[0]
    qkv = self.qkv(h)
    qs, ks = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
    q = qkv[:, :qs].view(T, self.num_heads, self.head_dim)
    k = qkv[:, qs: qs + ks].view(T, self.num_kv_heads, self.head_dim)
    v = qkv[:, qs + ks:].view(T, self.num_kv_heads, self.head_dim)
    if self.qk_norm:
        q, k = self.q_norm(q), self.k_norm(k)
    q = q * cos + _rotate_half(q) * sin
    k = k * cos + _rotate_half(k) * sin
    k_flat = k_cache.view(-1, self.num_kv_heads, self.head_dim)
    v_flat = v_cache.view(-1, self.num_kv_heads, self.head_dim)
    k_flat[batch.out_slots] = k.to(k_flat.dtype)
    v_flat[batch.out_slots] = v.to(v_flat.dtype)
    table = batch.extra.get("padded")
    if table is None:
        lens = [len(s.ctx_slots) for s in batch.seqs]
        width = max(lens)
        idx = torch.zeros(len(lens), width, dtype=torch.long)
        for i, s in enumerate(batch.seqs):
            idx[i, : lens[i]] = s.ctx_slots
        mask = torch.arange(width).unsqueeze(0) < torch.tensor(lens).unsqueeze(1)
        table = batch.extra["padded"] = (idx, mask[:, None, None, :])
    idx, mask = table
    kb = k_flat[idx].transpose(1, 2).to(q.dtype)  # [B, KVH, W, D]
    vb = v_flat[idx].transpose(1, 2).to(q.dtype)
    o = F.scaled_dot_product_attention(q.unsqueeze(2), kb, vb, attn_mask=mask, scale=self.scale,
                                       enable_gqa=self.num_heads != self.num_kv_heads)
    return self.o_proj(o.reshape(T, -1))


def decode_batch(model: Any, batch_size: int, ctx: int, vocab: int) -> Any:
    """B sequences of `ctx` tokens, each adding one token: slots [i*ctx, (i+1)*ctx)."""
    from pdcore.engine.models.llama import ForwardBatch, SeqSpan

    g = torch.Generator().manual_seed(0)
    seqs = [SeqSpan(i, 1, torch.arange(i * ctx, (i + 1) * ctx)) for i in range(batch_size)]
    return ForwardBatch(
        input_ids=torch.randint(100, vocab, (batch_size,), generator=g),
        positions=torch.full((batch_size,), ctx - 1, dtype=torch.long),
        out_slots=torch.tensor([(i + 1) * ctx - 1 for i in range(batch_size)]),
        seqs=seqs, logit_rows=torch.arange(batch_size))


def op_groups(prof: Any, steps: int) -> dict[str, float]:
    """Self CPU ms per decode step, by op group."""
    out: dict[str, float] = defaultdict(float)
    for e in prof.key_averages():
        group = next((g for g, keys in OP_GROUPS if any(k in e.key for k in keys)), "other")
        out[group] += e.self_cpu_time_total / 1000.0 / steps
    return dict(out)


# -- measurements ------------------------------------------------------------------------------
def per_step_costs(runners: dict[str, Any], prompts: list[list[int]], n: int, reps: int
                   ) -> dict[str, dict[str, float]]:
    raw: dict[str, dict[str, list[float]]] = {s: {"t1": [], "tn": []} for s in runners}
    for rep in range(reps):
        for s in alternating(list(runners), rep):
            for key, new in (("t1", 1), ("tn", n + 1)):
                t0 = CLOCK[0]()
                runners[s].generate(prompts, new)
                raw[s][key].append(CLOCK[0]() - t0)
    out = {}
    for s, r in raw.items():
        t1, tn = statistics.median(r["t1"]), statistics.median(r["tn"])
        out[s] = {"prefill_s": t1, "decode_step_ms": (tn - t1) / n * 1000,
                  "raw_t1": r["t1"], "raw_tn": r["tn"]}
    return out


def forward_variants(engines: dict[str, Any], batch_size: int, ctx: int, vocab: int,
                     iters: int) -> dict[str, Any]:
    """Decode-step time of the model alone, per variant: (engine, attention forward) pairs, run
    in alternating order; op groups from the torch profiler; logits checked against the first."""
    from pdcore.engine.models import llama

    original = llama.Attention.forward
    variants = {"loop (as is)": ("float32", original),
                "batched (prototype)": ("float32", batched_decode_attention)}
    if "bfloat16" in engines:
        variants["loop, bf16 weights"] = ("bfloat16", original)
        variants["batched, bf16 weights"] = ("bfloat16", batched_decode_attention)
    times: dict[str, list[float]] = {v: [] for v in variants}
    logits, groups = {}, {}
    for _, kv in engines.values():  # the same cached K/V in every pool, so logits compare
        g = torch.Generator().manual_seed(1)
        for k, v in kv.layers:
            for t in (k, v):
                t.copy_(torch.randn(t.shape, generator=g))
    try:
        for rep in range(iters):
            for name in alternating(list(variants), rep):
                dtype, fn = variants[name]
                model, kv = engines[dtype]
                llama.Attention.forward = fn
                batch = decode_batch(model, batch_size, ctx, vocab)
                t0 = CLOCK[0]()
                logits[name] = model(batch, kv.layers)
                times[name].append((CLOCK[0]() - t0) * 1000)
        for name, (dtype, fn) in variants.items():
            model, kv = engines[dtype]
            llama.Attention.forward = fn
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
                for _ in range(3):
                    model(decode_batch(model, batch_size, ctx, vocab), kv.layers)
            groups[name] = op_groups(p, 3)
    finally:
        llama.Attention.forward = original
    ref = logits["loop (as is)"]
    return {"step_ms": {k: statistics.median(v) for k, v in times.items()}, "raw_ms": times,
            "op_ms": groups,  # profiler self time (wall-based, so inflated by preemption)
            "op_share": {k: {g: t / sum(v.values()) for g, t in v.items()}
                         for k, v in groups.items()},
            "max_abs_logit_diff_vs_loop": {k: float((v - ref).abs().max())
                                           for k, v in logits.items()},
            "same_argmax_vs_loop": {k: bool((v.argmax(-1) == ref.argmax(-1)).all())
                                    for k, v in logits.items()}}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=256, help="context per sequence (decode step)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=["cpu", "wall"], default="cpu",
                    help="cpu: this process's CPU time (meaningful with --threads 1)")
    ap.add_argument("--out-dir", type=Path, default=None)
    ap.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True,
                    help="also time the decode step with bfloat16 weights")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.ctx, args.prompt_len, args.new_tokens, args.reps, args.iters = 64, 32, 8, 1, 3
    torch.set_num_threads(args.threads)
    CLOCK[0] = time.process_time if args.clock == "cpu" else time.perf_counter
    run = Run(NAME, {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()})
    tokens = max(args.batch * (args.ctx + 1), args.batch * (args.prompt_len + args.new_tokens + 8))
    pd = PdserveRunner(args.model_path, tokens)
    hf = TransformersRunner(args.model_path)
    bf = PdserveRunner(args.model_path, tokens, "bfloat16") if args.bf16 else None
    try:
        prompts = make_prompts(args.batch, args.prompt_len, pd.vocab, 1)
        for r in (pd, hf):
            r.generate(prompts, 2)
        steps = per_step_costs({"pdserve": pd, "transformers": hf}, prompts, args.new_tokens,
                               args.reps)
        engines = {"float32": (pd.engine.engine.model, pd.engine.engine.kv)}
        if bf is not None:
            engines["bfloat16"] = (bf.engine.engine.model, bf.engine.engine.kv)
        fwd = forward_variants(engines, args.batch, args.ctx, pd.vocab, args.iters)
    finally:
        for r in (pd, hf, bf):
            if r is not None:
                r.close()
    data = {"per_step": steps, "decode_forward": fwd,
            "ratios": {
                "transformers_over_pdserve_decode_step": ratio(
                    steps["transformers"]["decode_step_ms"], steps["pdserve"]["decode_step_ms"]),
                "transformers_over_pdserve_prefill": ratio(
                    steps["transformers"]["prefill_s"], steps["pdserve"]["prefill_s"]),
                **{f"loop_over_{k.split(' (')[0].replace(', ', '_').replace(' ', '_')}_step":
                   ratio(fwd["step_ms"]["loop (as is)"], v)
                   for k, v in fwd["step_ms"].items() if k != "loop (as is)"}}}
    path = run.finish(data, args.out_dir)
    print(f"\nbatch {args.batch}, prompts <= {args.prompt_len} tokens, threads {args.threads}, "
          f"{args.clock} clock")
    for s, v in steps.items():
        print(f"  {s:13s} prefill {v['prefill_s'] * 1000:8.1f} ms   decode step "
              f"{v['decode_step_ms']:7.1f} ms")
    print(f"decode forward, {args.batch} seqs x ctx {args.ctx} (model only):")
    for name, ms in fwd["step_ms"].items():
        ops = ", ".join(f"{g} {t:.0%}" for g, t in sorted(fwd["op_share"][name].items()))
        print(f"  {name:22s} {ms:7.1f} ms   [{ops}]")
    for name, diff in fwd["max_abs_logit_diff_vs_loop"].items():
        print(f"  {name:22s} max |logit diff| vs loop {diff:.2e}, "
              f"same argmax {fwd['same_argmax_vs_loop'][name]}")
    print("RATIOS " + ", ".join(f"{k} {v:.2f}x" for k, v in data["ratios"].items()))
    print(f"({load_note(run)}) -> {path}")
    return data


if __name__ == "__main__":
    main()
