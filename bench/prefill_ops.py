"""Where a prefill forward of pdserve's own model spends its time, per op group (#47).

SmolLM2-135M's shapes (or --model-path's config), float32, random weights (the op costs do
not depend on the values), packed and prepared as the engine prepares them
(prepare_for_inference); the pool float32, one slot per token. For each shape (sequences x
prompt tokens: 1x512, 4x512, 1x2048 by default) one prefill ForwardBatch is run:
1. unprofiled, --reps times: wall ms of the forward, ms per prompt token, and the minor page
   faults a forward takes (fresh pages the allocator maps for the step's tensors);
2. under torch.profiler, --prof-reps times: CPU time of the calling thread per top-level
   operator (its children included: F.rms_norm's parts count as rmsnorm), grouped (GROUPS:
   gemm, attention, rope_store, rmsnorm, residual add, silu_mul, copies, other), per prompt
   token, and the GEMMs' rate (2 x parameters-in-GEMMs FLOP per token over their time).
A fused residual add + RMSNorm (pdcore_native::add_rms_norm) counts as rmsnorm.

The thread placement is the server's on a 2-core box (OMP_PROC_BIND close, one thread per CPU,
bounded spin), set before torch loads unless already set.
Writes bench/results/prefill_ops_<tag>.json. Run as a timing run:
`flock -w 3600 /tmp/pd-quiet.lock nice -n -10 python bench/prefill_ops.py --tag s8`.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

for _k, _v in (("OMP_PROC_BIND", "close"), ("GOMP_SPINCOUNT", "30000")):
    os.environ.setdefault(_k, _v)
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from common import Run, load_note

NAME = "prefill_ops"
SMOLLM2 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
           "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
           "num_key_value_heads": 3, "rms_norm_eps": 1e-5, "vocab_size": 49152,
           "rope_theta": 100000.0, "max_position_embeddings": 8192,
           "tie_word_embeddings": True, "hidden_act": "silu"}
# first match wins, on the profiler's operator name
GROUPS = (("gemm", ("pdcore_native::linear", "mkldnn::_linear_pointwise", "aten::mm",
                    "aten::addmm", "aten::linear")),
          ("attention", ("prefill_attention", "scaled_dot_product", "flash_attention")),
          ("rope_store", ("rope_store",)),
          ("rmsnorm", ("rms_norm",)),  # add_rms_norm too
          ("residual_add", ("aten::add",)),
          ("silu_mul", ("silu", "aten::mul")),
          ("copies", ("aten::copy_", "aten::index", "aten::contiguous", "aten::clone",
                      "aten::cat", "aten::empty", "aten::to", "aten::_to_copy")))


def config(model_path: str | None) -> Any:
    from pdcore.engine.model.hf_config import read_plain_config
    from pdcore.engine.model.llama import SUPPORTED_ARCHS

    if model_path:
        cfg = read_plain_config(model_path, tuple(SUPPORTED_ARCHS))
        if cfg is None:
            raise SystemExit(f"{model_path}: not a plain Llama-family config")
        return cfg
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(SMOLLM2))
        return read_plain_config(d, tuple(SUPPORTED_ARCHS))


def build_model(cfg: Any) -> torch.nn.Module:
    from pdcore.engine.model.llama import LlamaForCausalLM

    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        model = LlamaForCausalLM(cfg)
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        model.prepare_for_inference()
    return model.eval()


def gemm_flop_per_token(cfg: Any) -> float:
    h, i, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    hd = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    return 2.0 * L * (h * (q + 2 * kv) + q * h + 3 * h * i)


def prefill_batch(seqs: int, prompt: int, vocab: int, seed: int) -> Any:
    from pdcore.engine.model.batch import ForwardBatch, SeqSpan

    g = torch.Generator().manual_seed(seed)
    spans = [SeqSpan(i * prompt, prompt, torch.arange(i * prompt, (i + 1) * prompt))
             for i in range(seqs)]
    T = seqs * prompt
    return ForwardBatch(input_ids=torch.randint(100, vocab, (T,), generator=g),
                        positions=torch.arange(prompt).repeat(seqs), out_slots=torch.arange(T),
                        seqs=spans, logit_rows=torch.arange(prompt - 1, T, prompt))


def group_of(key: str) -> str:
    return next((g for g, keys in GROUPS if any(k in key for k in keys)), "other")


def measure(model: torch.nn.Module, cfg: Any, seqs: int, prompt: int, reps: int,
            prof_reps: int) -> dict[str, Any]:
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    T = seqs * prompt
    kv = [(torch.zeros(T, 1, cfg.num_key_value_heads, hd),
           torch.zeros(T, 1, cfg.num_key_value_heads, hd)) for _ in range(cfg.num_hidden_layers)]
    for w in range(2):  # warm: oneDNN primitives, the allocator
        model(prefill_batch(seqs, prompt, cfg.vocab_size, w), kv)
    walls, faults = [], []
    for r in range(reps):
        b = prefill_batch(seqs, prompt, cfg.vocab_size, 10 + r)
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t = time.perf_counter()
        model(b, kv)
        walls.append(time.perf_counter() - t)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    ops: dict[str, float] = defaultdict(float)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for r in range(prof_reps):
            model(prefill_batch(seqs, prompt, cfg.vocab_size, 100 + r), kv)
    for e in prof.events():  # top-level operators, their children included (rms_norm's)
        if e.cpu_parent is None:
            ops[e.name] += e.cpu_time_total / 1000.0 / prof_reps
    groups: dict[str, float] = defaultdict(float)
    for k, ms in ops.items():
        groups[group_of(k)] += ms
    wall = statistics.median(walls)
    gemm_ms = groups.get("gemm", 0.0)
    flop = gemm_flop_per_token(cfg) * T
    top = sorted(ops.items(), key=lambda kv_: -kv_[1])[:16]
    return {
        "seqs": seqs, "prompt": prompt, "tokens": T,
        "wall_ms": [round(w * 1e3, 2) for w in walls], "median_ms": round(wall * 1e3, 2),
        "ms_per_token": round(wall * 1e3 / T, 4),
        "minor_faults_per_forward": int(statistics.median(faults)),
        "profiled_ms": round(sum(ops.values()), 2),
        "groups_ms": {k: round(v, 2) for k, v in sorted(groups.items(), key=lambda x: -x[1])},
        "groups_ms_per_token": {k: round(v / T, 4) for k, v in groups.items()},
        "non_gemm_ms_per_token": round((sum(groups.values()) - gemm_ms) / T, 4),
        "gemm_gflops": round(flop / (gemm_ms / 1e3) / 1e9, 1) if gemm_ms else None,
        "top_ops_ms": {k: round(v, 2) for k, v in top},
    }


def elementwise_ab(cfg: Any, tokens: int, reps: int) -> dict[str, Any]:
    """The residual add + RMSNorm and silu * up of one forward (2 norms and 1 MLP a layer) at
    `tokens` rows, aten's operators against the fused native ones, alternating in this process:
    wall ms a forward (best of `reps`)."""
    import torch.nn.functional as F

    from pdcore.engine import native

    o = native.ops()
    H, I, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    g = torch.Generator().manual_seed(0)
    res, x = torch.randn(tokens, H, generator=g), torch.randn(tokens, H, generator=g)
    w, gu = torch.randn(H, generator=g), torch.randn(tokens, 2 * I, generator=g)

    def aten() -> None:
        for _ in range(L):
            for _ in range(2):
                F.rms_norm(res.add_(x), (H,), w, 1e-5)
            F.silu(gu[:, :I]) * gu[:, I:]

    def fused() -> None:
        for _ in range(L):
            for _ in range(2):
                o.add_rms_norm(res, x, w, 1e-5)
            o.silu_mul(gu, I)

    best = {"aten": float("inf"), "fused": float("inf")}
    for r in range(reps):
        for name, fn in ((("aten", aten), ("fused", fused)) if r % 2 == 0
                         else (("fused", fused), ("aten", aten))):
            t = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t)
    return {"tokens": tokens, **{k: round(v * 1e3, 2) for k, v in best.items()}}


def plot(paths: list[Path], out_name: str) -> Path:
    """Stacked ms per prompt token by op group, one bar per (run, shape): runs side by side."""
    from common import figure, save_figure

    runs = [json.loads(p.read_text()) for p in paths]
    names = list(dict.fromkeys(g for r in runs for s in r["shapes"] for g in s["groups_ms"]))
    fig, (ax,) = figure(1, width=9.0, height=4.5)
    labels, bottoms = [], []
    for r in runs:
        for s in r["shapes"]:
            labels.append(f"{r['name'].removeprefix(NAME + '_')}\n{s['seqs']}x{s['prompt']}")
            bottoms.append(s["groups_ms_per_token"])
    base = [0.0] * len(labels)
    for g in names:
        vals = [b.get(g, 0.0) for b in bottoms]
        ax.bar(range(len(labels)), vals, bottom=base, label=g)
        base = [a + v for a, v in zip(base, vals)]
    ax.set_xticks(range(len(labels)), labels, fontsize=7)
    ax.set_ylabel("ms per prompt token (profiled)")
    ax.set_title("prefill forward by op group (SmolLM2 float32, 2 threads)")
    ax.legend(fontsize=7)
    return save_figure(fig, out_name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", default=None, help="a config to take the shapes from")
    ap.add_argument("--shapes", default="1x512,4x512,1x2048", help="seqs x prompt tokens")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--prof-reps", type=int, default=2)
    ap.add_argument("--tag", default="")
    ap.add_argument("--ab-tokens", default="", help="rows of the elementwise A/B (e.g. 512,2048)")
    ap.add_argument("--plot", nargs="+", type=Path, default=None,
                    help="only draw these result JSONs side by side (into --tag's PNG)")
    args = ap.parse_args()
    if args.plot:
        print(plot(args.plot, NAME + (f"_{args.tag}" if args.tag else "")))
        return
    torch.set_num_threads(args.threads)
    run = Run(NAME + (f"_{args.tag}" if args.tag else ""), vars(args))
    cfg = config(args.model_path)
    model = build_model(cfg)
    from pdcore.engine.model.layers import weight_layouts

    data: dict[str, Any] = {"weight_layouts": weight_layouts(model), "shapes": []}
    for shape in filter(None, args.shapes.split(",")):
        s, p = (int(x) for x in shape.split("x"))
        row = measure(model, cfg, s, p, args.reps, args.prof_reps)
        data["shapes"].append(row)
        print(f"{shape}: {row['median_ms']:.1f} ms ({row['ms_per_token']:.3f} ms/token, "
              f"{row['minor_faults_per_forward']} faults); GEMM {row['gemm_gflops']} GFLOP/s; "
              f"non-GEMM {row['non_gemm_ms_per_token']:.3f} ms/token: {row['groups_ms']}",
              flush=True)
    if args.ab_tokens:
        data["elementwise_ab"] = [elementwise_ab(cfg, int(t), args.reps)
                                  for t in args.ab_tokens.split(",")]
        print("elementwise, ms a forward:", data["elementwise_ab"], flush=True)
    data["load"] = load_note(run)
    path = run.finish(data)
    print(f"{data['load']}; wrote {path}")


if __name__ == "__main__":
    main()
