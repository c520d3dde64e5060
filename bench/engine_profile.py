"""Where a pdserve decode step spends its time, against transformers, and what each of the
engine's batched decode attention is worth.

Lifecycle:
1. load pdserve's engine (LLMEngine) and transformers on the same weights, same torch threads;
2. per-step cost from end-to-end generate calls: prefill-only (1 new token) and prefill + N
   decode steps, alternating the systems; step = (T(N+1) - T(1)) / N, prefill = T(1);
3. a decode step of pdserve's model alone (ForwardBatch of B sequences x ctx tokens built by
   hand) per variant (VARIANTS: the engine as is; batched attention off (one SDPA per sequence);
   bfloat16 weights with --bf16), alternating; logits compared with the engine as is;
4. torch profiler of decode steps per variant: share of time per op group (matmul, K/V gather,
   SDPA, K/V write, other = elementwise, norms, rotary, copies);
5. print everything; write bench/results/engine_profile.json and .png (`--replot` redraws the
   PNG from the JSON).

Run: `python bench/engine_profile.py [--batch 16] [--ctx 256] [--threads 1] [--quick]`.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from common import RESULTS, Run, alternating, figure, load_note, ratio, save_figure
from engine_throughput import PdserveRunner, TransformersRunner, make_prompts

NAME = "engine_profile"
# process CPU time by default: with one torch thread it is the cost on a core of one's own,
# which the shared machine's load disturbs far less than the wall clock (--clock wall)
CLOCK = [time.process_time]
# first match wins (kv_write before kv_gather: "aten::index_put" contains "aten::index")
OP_GROUPS = (("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "mkl::_mkl_linear",
                         "mkldnn::_linear_pointwise")),
             ("kv_write", ("aten::index_put", "aten::_index_put_impl_")),
             ("kv_gather", ("aten::index", "aten::index_select")),
             ("sdpa", ("flash_attention", "aten::_scaled_dot_product", "aten::baddbmm",
                       "aten::_softmax")))


# -- the variants ------------------------------------------------------------------------------
# The engine as is batches the decode sequences' attention (one padded gather + masked SDPA);
# "per-seq attention" makes ForwardBatch.decode_group return None (one SDPA per sequence).
# The hand-built batches carry no request keys, so the decode K/V view (decode_view.py) stays
# out of these variants: they time the gather path; bench/step_vs_gemm.py times the view.
# The reordered (oneDNN) GEMM weights replace the originals, so no variant switches them off:
# PDCORE_CPU_PACKED_GEMM=0 in the environment times the engine without them.
VARIANTS = {  # name: (weights dtype, batched attention)
    "as is": ("float32", True),
    "per-seq attention": ("float32", False),
    "as is, bf16 weights": ("bfloat16", True),
}


class Switches:
    """Turns batched decode attention on and off in place (back on in `restore`)."""

    def __init__(self) -> None:
        from pdcore.engine.model import llama

        self.llama, self.group = llama, llama.ForwardBatch.decode_group

    def set(self, batched: bool) -> None:
        self.llama.ForwardBatch.decode_group = self.group if batched else (lambda self: None)

    def restore(self) -> None:
        self.set(True)


def decode_batch(model: Any, batch_size: int, ctx: int, vocab: int) -> Any:
    """B sequences of `ctx` tokens, each adding one token: slots [i*ctx, (i+1)*ctx)."""
    from pdcore.engine.model.batch import ForwardBatch, SeqSpan

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
    """Decode-step time of the model alone, per variant (weights dtype, batched attention or
    not), run in alternating order; op groups from the torch profiler;
    logits checked against the engine as is."""
    variants = {k: v for k, v in VARIANTS.items() if v[0] in engines}
    switches = Switches()

    def use(name: str) -> tuple[Any, Any]:
        dtype, batched = variants[name]
        switches.set(batched)
        return engines[dtype]

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
                model, kv = use(name)
                batch = decode_batch(model, batch_size, ctx, vocab)
                t0 = CLOCK[0]()
                logits[name] = model(batch, kv.layers)
                times[name].append((CLOCK[0]() - t0) * 1000)
        for name in variants:
            model, kv = use(name)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
                for _ in range(3):
                    model(decode_batch(model, batch_size, ctx, vocab), kv.layers)
            groups[name] = op_groups(p, 3)
    finally:
        switches.restore()
    ref = logits["as is"]
    return {"step_ms": {k: statistics.median(v) for k, v in times.items()}, "raw_ms": times,
            "op_ms": groups,  # profiler self time (wall-based, so inflated by preemption)
            "op_share": {k: {g: t / sum(v.values()) for g, t in v.items()}
                         for k, v in groups.items()},
            "max_abs_logit_diff_vs_as_is": {k: float((v - ref).abs().max())
                                           for k, v in logits.items()},
            "same_argmax_vs_as_is": {k: bool((v.argmax(-1) == ref.argmax(-1)).all())
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
    ap.add_argument("--replot", action="store_true", help="only redraw the PNG from the JSON")
    args = ap.parse_args(argv)
    if args.replot:
        data = json.loads(((args.out_dir or RESULTS) / f"{NAME}.json").read_text())
        m = data["machine"]
        plot(data, f"load avg {m['loadavg_start'][0]:.1f} -> {m['loadavg_end'][0]:.1f} on "
                   f"{m['nproc']} CPUs", args.out_dir)
        return data
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
                **{re.sub(r"[^a-z0-9]+", "_", k.split(" (")[0]) + "_over_as_is_step":
                   ratio(v, fwd["step_ms"]["as is"])
                   for k, v in fwd["step_ms"].items() if k != "as is"}}}
    path = run.finish(data, args.out_dir)
    plot(json.loads(path.read_text()), load_note(run), args.out_dir)
    print(f"\nbatch {args.batch}, prompts <= {args.prompt_len} tokens, threads {args.threads}, "
          f"{args.clock} clock")
    for s, v in steps.items():
        print(f"  {s:13s} prefill {v['prefill_s'] * 1000:8.1f} ms   decode step "
              f"{v['decode_step_ms']:7.1f} ms")
    print(f"decode forward, {args.batch} seqs x ctx {args.ctx} (model only):")
    for name, ms in fwd["step_ms"].items():
        ops = ", ".join(f"{g} {t:.0%}" for g, t in sorted(fwd["op_share"][name].items()))
        print(f"  {name:22s} {ms:7.1f} ms   [{ops}]")
    for name, diff in fwd["max_abs_logit_diff_vs_as_is"].items():
        print(f"  {name:22s} max |logit diff| vs as is {diff:.2e}, "
              f"same argmax {fwd['same_argmax_vs_as_is'][name]}")
    print("RATIOS " + ", ".join(f"{k} {v:.2f}x" for k, v in data["ratios"].items()))
    print(f"({load_note(run)}) -> {path}")
    return data


def plot(data: dict[str, Any], note: str, out_dir: Path | None) -> None:
    """Left: e2e prefill and decode step per system. Right: model-only decode step per variant,
    split by op group (profiler shares applied to the measured step time)."""
    steps, fwd = data["per_step"], data["decode_forward"]
    fig, (a, b) = figure(2, 5.5, 4.4)
    names = list(steps)
    a.bar([f"{n}\nprefill (s)" for n in names], [steps[n]["prefill_s"] for n in names],
          color=["C0", "C1"])
    a2 = a.twinx()
    a2.bar([f"{n}\ndecode step (ms)" for n in names],
           [steps[n]["decode_step_ms"] for n in names], color=["C0", "C1"], hatch="//")
    a.set_ylabel("prefill (s)")
    a2.set_ylabel("decode step (ms)")
    a.set_title("end to end, batch of prompts", fontsize=10)
    a.tick_params(axis="x", labelsize=7)
    variants = list(fwd["step_ms"])
    bottom = [0.0] * len(variants)
    for group in ("matmul", "kv_gather", "sdpa", "kv_write", "other"):
        vals = [fwd["step_ms"][v] * fwd["op_share"][v].get(group, 0.0) for v in variants]
        b.bar(range(len(variants)), vals, bottom=bottom, label=group)
        bottom = [x + y for x, y in zip(bottom, vals)]
    labels = [v.replace(" (", "\n(").replace(", ", ",\n").replace(" + ", "\n+ ")
              for v in variants]
    b.set_xticks(range(len(variants)), labels, fontsize=7)
    b.set_ylabel("ms per decode step")
    b.set_title("model-only decode step by op group", fontsize=10)
    b.legend(fontsize=7)
    fig.suptitle(f"{data['name']}: batch {data['config']['batch']}, ctx {data['config']['ctx']}, "
                 f"{data['config']['clock']} clock; {note}", fontsize=9)
    save_figure(fig, NAME, out_dir)


if __name__ == "__main__":
    main()
