"""Engine throughput: output tokens/s of pdserve's engine (LLMEngine, in-process) against
transformers `generate` on the same weights and prompts, batch 1 and 16, in one run.

Lifecycle:
1. load both models in this process (same GGUF/HF folder, float32, same torch threads) and build
   the prompts: random token ids (fixed seed), lengths spread over [prompt_len/2, prompt_len] so
   transformers' left padding is exercised;
2. warm up each system once per batch size;
3. for each repetition and batch size, run the systems in alternating order (A,B then B,A) so
   a drifting machine load biases neither; both are greedy and generate exactly `--new-tokens`
   per sequence (pdserve: ignore_eos; transformers: no eos token), timed end to end (prefill +
   decode);
4. check the outputs agree token for token (a sanity check that both did the same work);
5. print tokens/s medians and RATIO = pdserve / transformers per batch size, by wall clock and
   by this process's CPU time (tokens per CPU-second: with one torch thread it is the rate on a
   core of one's own, which a shared machine's load disturbs far less than the wall clock);
   write bench/results/engine_throughput.json and .png.
Unless --no-bf16, pdserve with --dtype bfloat16 runs alongside as a third system (AMX matmuls on
recent x86), reported as its own ratio: it is not the float32 comparison the target is about.

Run: `python bench/engine_throughput.py [--quick] [--model-path PATH] [--batch-sizes 1 16]`.
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from common import (
    Run,
    alternating,
    bar_groups,
    figure,
    load_note,
    ratio,
    save_figure,
    summary,
)

NAME = "engine_throughput"
SYSTEMS = ("pdserve", "transformers")  # the compared pair, both float32
EXTRA = "pdserve-bf16"  # optional third system: pdserve with --dtype bfloat16 (AMX on x86)


def make_prompts(batch: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # skip the low ids, where tokenizers keep their special tokens
    return [[rng.randrange(100, vocab) for _ in range(rng.randint(max(1, prompt_len // 2),
                                                                   prompt_len))]
            for _ in range(batch)]


class PdserveRunner:
    def __init__(self, model_path: str | None, max_total_tokens: int, dtype: str = "float32"
                 ) -> None:
        from pdcore.config import ServerArgs
        from pdcore.runtime.llm_engine import LLMEngine

        self.engine = LLMEngine(ServerArgs(model_path=model_path, max_total_tokens=max_total_tokens,
                                           dtype=dtype, log_level="warning"))
        self.vocab = self.engine.engine.hf_config.vocab_size

    def generate(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        from pdcore.messages.io import SamplingParams

        sp = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        return [o["output_ids"] for o in self.engine.generate(prompts, sp)]

    def close(self) -> None:
        self.engine.close()


class TransformersRunner:
    def __init__(self, model_path: str | None) -> None:
        import transformers
        from transformers import AutoModelForCausalLM

        from pdcore.engine.model.tokenizer import resolve_model

        resolved = resolve_model(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(
            resolved.path, dtype=torch.float32, **resolved.hf_kwargs()).eval()
        gen = copy.deepcopy(self.model.generation_config)
        # no eos: exactly max_new_tokens per row, like pdserve's ignore_eos
        gen.eos_token_id = None
        gen.pad_token_id = 0
        gen.do_sample, gen.temperature, gen.top_p, gen.top_k = False, None, None, None
        self.gen = gen
        transformers.logging.set_verbosity_error()

    def generate(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros(len(prompts), width, dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        with torch.inference_mode():
            gen = copy.copy(self.gen)
            gen.max_new_tokens = gen.min_new_tokens = new_tokens
            out = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=gen)
        return out[:, width:].tolist()

    def close(self) -> None:
        del self.model


def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, Any]:
    """Sequences identical, and the mean length of the common prefix (as a fraction)."""
    same = sum(x == y for x, y in zip(a, b))
    prefix = []
    for x, y in zip(a, b):
        k = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
        prefix.append(k / max(1, len(x)))
    return {"identical": same, "of": len(a), "mean_common_prefix": statistics.fmean(prefix)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", default=None, help="GGUF file or HF folder (default SmolLM2)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--prompt-len", type=int, default=128, help="longest prompt (tokens)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads for both systems (0: torch's default). 1 by default: on "
                         "a shared machine, OpenMP barriers of 2+ threads stall when a core is "
                         "taken, which punishes many small ops far more than a few big ones")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True,
                    help=f"also run {EXTRA} (pdserve --dtype bfloat16), reported apart")
    ap.add_argument("--out-dir", type=Path, default=None)
    ap.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    args = ap.parse_args(argv)
    if args.quick:
        args.prompt_len, args.new_tokens, args.reps, args.bf16 = 32, 16, 1, False
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    config["torch_threads"] = torch.get_num_threads()
    run = Run(NAME, config)
    max_tokens = max(args.batch_sizes) * (args.prompt_len + args.new_tokens + 16)
    systems = [*SYSTEMS, *([EXTRA] if args.bf16 else [])]
    runners: dict[str, Any] = {}
    try:
        runners["pdserve"] = PdserveRunner(args.model_path, max_tokens)
        runners["transformers"] = TransformersRunner(args.model_path)
        if args.bf16:
            runners[EXTRA] = PdserveRunner(args.model_path, max_tokens, "bfloat16")
        raw, cpu_raw, outputs = measure(runners, systems, args)
    finally:
        for r in runners.values():
            r.close()
    medians = {s: {b: statistics.median(v) for b, v in raw[s].items()} for s in systems}
    ratios = {s: {b: ratio(medians[s][b], medians["transformers"][b]) for b in raw[s]}
              for s in systems if s != "transformers"}
    cpu_medians = {s: {b: statistics.median(v) for b, v in cpu_raw[s].items()} for s in systems}
    cpu_ratios = {s: {b: ratio(cpu_medians[s][b], cpu_medians["transformers"][b]) for b in raw[s]}
                  for s in systems if s != "transformers"}
    agree = {s: {str(b): agreement(outputs[s][b], outputs["transformers"][b])
                 for b in args.batch_sizes} for s in systems if s != "transformers"}
    path = run.finish({
        "systems": systems, "raw_tokens_per_s": raw,
        "raw_tokens_per_cpu_s": cpu_raw, "median_tokens_per_cpu_s": cpu_medians,
        "ratio_per_cpu_s_over_transformers": cpu_ratios,
        "summary": {s: {b: summary(v) for b, v in raw[s].items()} for s in systems},
        "median_tokens_per_s": medians, "ratio_over_transformers": ratios,
        "ratio_pdserve_over_transformers": ratios["pdserve"],
        "output_agreement_with_transformers": agree,
        "target": {"batch": 16, "min_ratio": 2.0, "system": "pdserve"},
    }, args.out_dir)
    plot([("output tokens/s", raw), ("output tokens per CPU-second", cpu_raw)], systems, args,
         load_note(run), args.out_dir)
    print(f"\n{'batch':>5} {'system':>13} {'tok/s':>8} {'RATIO':>7} {'tok/cpu-s':>10} "
          f"{'RATIO':>7}  identical to transformers")
    for b in raw["pdserve"]:
        for s in systems:
            r = "" if s == "transformers" else (
                f"{ratios[s][b]:6.2f}x {cpu_medians[s][b]:10.1f} {cpu_ratios[s][b]:6.2f}x  "
                f"{agree[s][b]['identical']}/{agree[s][b]['of']}")
            if s == "transformers":
                r = f"{'':7s} {cpu_medians[s][b]:10.1f}"
            print(f"{b:>5} {s:>13} {medians[s][b]:8.1f} {r}")
    print(f"({load_note(run)}; torch threads {torch.get_num_threads()}; target pdserve >= 2x "
          f"transformers at batch 16) -> {path}")
    return {"path": str(path), "ratios": ratios, "cpu_ratios": cpu_ratios}


def measure(runners: dict[str, Any], systems: list[str], args: argparse.Namespace
            ) -> tuple[dict[str, dict[str, list[float]]], dict[str, dict[str, list[float]]],
                       dict[str, dict[int, list[list[int]]]]]:
    vocab = runners["pdserve"].vocab
    prompts = {b: make_prompts(b, args.prompt_len, vocab, args.seed + b) for b in args.batch_sizes}
    raw: dict[str, dict[str, list[float]]] = {s: {str(b): [] for b in args.batch_sizes}
                                              for s in systems}
    cpu_raw: dict[str, dict[str, list[float]]] = {s: {str(b): [] for b in args.batch_sizes}
                                                  for s in systems}
    outputs: dict[str, dict[int, list[list[int]]]] = {s: {} for s in systems}
    for b in args.batch_sizes:  # warm-up (allocator, kernels, caches)
        for s in systems:
            runners[s].generate(prompts[b], min(4, args.new_tokens))
    for rep in range(args.reps):
        for b in args.batch_sizes:
            for s in alternating(systems, rep + b):
                t0, c0 = time.perf_counter(), time.process_time()
                out = runners[s].generate(prompts[b], args.new_tokens)
                dt, cpu = time.perf_counter() - t0, time.process_time() - c0
                n = sum(len(o) for o in out)
                if n != b * args.new_tokens:
                    raise RuntimeError(f"{s} made {n} tokens, want {b * args.new_tokens}")
                raw[s][str(b)].append(n / dt)
                cpu_raw[s][str(b)].append(n / cpu)
                outputs[s][b] = out
                print(f"rep {rep} batch {b:3d} {s:13s} {n / dt:8.1f} tok/s ({dt:.2f} s), "
                      f"{n / cpu:8.1f} tok/cpu-s",
                      flush=True)
    return raw, cpu_raw, outputs


def plot(panels: list[tuple[str, dict[str, dict[str, list[float]]]]], systems: list[str],
         args: argparse.Namespace, note: str, out_dir: Path | None) -> None:
    """One panel per metric (wall clock, CPU time): median bars, min..max whiskers."""
    fig, axes = figure(len(panels), 5.5, 4.2)
    for ax, (label, raw) in zip(axes, panels):
        med = {s: {b: statistics.median(v) for b, v in raw[s].items()} for s in systems}
        groups = list(raw["pdserve"])
        bar_groups(ax, [f"batch {b}\n(pdserve {med['pdserve'][b] / med['transformers'][b]:.2f}x)"
                        for b in groups],
                   {s: [med[s][b] for b in groups] for s in systems}, label,
                   f"{label}, {args.new_tokens} new tokens, median of {args.reps}",
                   errors={s: [(min(raw[s][b]), max(raw[s][b])) for b in groups]
                           for s in systems})
    fig.suptitle(f"pdserve engine vs transformers generate (float32; torch threads "
                 f"{torch.get_num_threads()}); {note}", fontsize=9)
    save_figure(fig, NAME, out_dir)


if __name__ == "__main__":
    main()
