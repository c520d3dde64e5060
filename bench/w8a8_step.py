"""A W8A8 decode step at batch 8 taken apart, against its weight-streaming floors (#48).

The same compressed-tensors W8A8 checkpoint in pdserve's engine twice, in process: its lm_head
float as the checkpoint stores it (PDCORE_W8A8_LM_HEAD=float), quantized to
int8 at load (PDCORE_W8A8_LM_HEAD=int8, engine/model/quant.int8_lm_head) and rounded to bf16
weights (PDCORE_W8A8_LM_HEAD=bf16, the default since s9, loader.bf16_lm_head; --heads picks). For each,
wall-clock milliseconds on the engine's threads (medians over --iters, the two engines
alternating):

- body GEMMs: every layer's qkv, o, gate_up and down projection on B random rows, by kind
  (each kind's weights back to back: read from memory, as in a step);
- lm_head: the final projection on B rows (what the engine calls: float panels or int8);
- layers: the decode forward without logits (the native layer loop: GEMMs, attention,
  norms, rotary, K/V stores) over consecutive decode batches of B sequences growing from
  --ctx tokens (step_vs_gemm.decode_steps); "attention and the rest" = layers - body GEMMs;
- forward: the same with the final norm and logits; sampler: the engine's sampler over B rows
  of logits, greedy and at temperature 1;
- engine step (TPOT): (T(1 + N new tokens) - T(1)) / N of B prompts through LLMEngine
  (scheduler, batch building, forward, sampling, detokenizing); "Python and the scheduler" =
  TPOT - forward - greedy sampler.

--unfused adds, for each head, a twin engine whose native decode loop quantizes the int8 GEMMs'
inputs apart from the norm / silu_mul passes that make them (the model's native plan's
int8_fused off: the loop before engine/native/int8_act.h), timed alternating with the others.

Floors, with the read bandwidth measured in the run (a sum over 512 MiB of float32 on the
engine's threads, best of 4, as bench/quant_speed.py): "as stored" counts the bytes the step
must read given the checkpoint as it is (int8 body + float32 lm_head); "int8" the bytes with
every GEMM weight int8 (the issue's int8 weight-streaming floor: body + int8 lm_head).

Run: `python bench/w8a8_step.py --model-path /work/smollm2-w8a8 [--tag T]`; JSON + PNG in
bench/results/w8a8_step[_T].*.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from common import Run, alternating, figure, load_note, save_figure
from quant_speed import UNFUSED, _bandwidth, unfuse
from step_vs_gemm import decode_steps

NAME = "w8a8_step"
HEADS = ("float", "int8", "bf16")
KINDS = ("qkv", "o_proj", "gate_up", "down")


def _bytes(t: Any) -> int:
    return sum(_bytes(x) for x in t.tensors()) if hasattr(t, "tensors") and \
        not isinstance(t, torch.Tensor) else t.numel() * t.element_size()


def _wall_ms(fn: Any, per: int = 1) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3 / per


class Parts:
    """The timed pieces of one engine's decode step."""

    def __init__(self, eng: Any, batch: int, ctx: int, steps: int) -> None:
        from pdcore.engine.model.layers import linear
        from pdcore.engine.sched.sampler import SampleState, sample
        from pdcore.messages.io import SamplingParams

        self.eng, self.batch, self.steps = eng, batch, steps
        model, kv = eng.engine.model, eng.engine.kv
        vocab = eng.engine.hf_config.vocab_size
        mods = {"qkv": [x.self_attn.qkv for x in model.layers],
                "o_proj": [x.self_attn.o_proj for x in model.layers],
                "gate_up": [x.mlp.gate_up for x in model.layers],
                "down": [x.mlp.down for x in model.layers]}
        g = torch.Generator().manual_seed(0)
        self.kind_bytes = {k: sum(_bytes(m.int8 if m.int8 is not None else m.packed)
                                  for m in ms) for k, ms in mods.items()}
        head, packed = model.lm_head, model.lm_head_packed
        self.head_bytes = _bytes(packed if packed is not None else head)
        hx = torch.randn(batch, head.shape[1], generator=g)

        def kind(ms: list[Any]) -> Any:
            x = torch.randn(batch, ms[0].weight.shape[1], generator=g)
            return lambda: [m.int8(x) if m.int8 is not None else m(x) for m in ms]

        def forward(logits: bool) -> Any:
            batches = decode_steps(batch, ctx, steps, vocab, True)
            return lambda: [model(b, kv.layers, logits=logits) for b in batches]

        logits = torch.randn(batch, vocab, generator=g) * 4
        prompt = [1, 2, 3]

        def sampler(temp: float) -> Any:
            sp = SamplingParams(max_new_tokens=8, temperature=temp)
            return lambda: sample(logits, [SampleState.create(sp, prompt) for _ in range(batch)],
                                  [None] * batch)

        self.fns: dict[str, tuple[Any, int]] = {
            **{f"gemm_{k}": (kind(ms), 1) for k, ms in mods.items()},
            "lm_head": (lambda: linear(hx, head, None, packed), 1),
            "layers": (forward(False), steps), "forward": (forward(True), steps),
            "sampler_greedy": (sampler(0.0), 1), "sampler_t1": (sampler(1.0), 1)}
        self.prompts = [[(7 * i + 31 * j) % 5000 + 100 for j in range(64)] for i in range(batch)]

    def _generate(self, new: int) -> None:
        from pdcore.messages.io import SamplingParams

        self.eng.generate(self.prompts, SamplingParams(max_new_tokens=new, temperature=0.0,
                                                       ignore_eos=True))

    @torch.inference_mode()
    def once(self, out: dict[str, list[float]], new: int) -> None:
        for name, (fn, per) in self.fns.items():
            fn()  # warm (a forward's K/V view fills on its first step)
            out.setdefault(name, []).append(_wall_ms(fn, per))
        short = _wall_ms(lambda: self._generate(1))
        long = _wall_ms(lambda: self._generate(1 + new))
        out.setdefault("engine_step", []).append((long - short) / new)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", required=True, help="a compressed-tensors W8A8 folder")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=96)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--heads", default=",".join(HEADS),
                    help=f"PDCORE_W8A8_LM_HEAD values to run, of {HEADS} (float and int8 "
                         "always: the floors)")
    ap.add_argument("--unfused", action="store_true",
                    help="each head also as '<head>_unfused': the activation quantization apart "
                         "from the norm / silu_mul passes (the loop before int8_act.h)")
    ap.add_argument("--tag", default=None, help="results in w8a8_step_<tag>.json / .png")
    a = ap.parse_args()
    heads = [h for h in HEADS if h in ("float", "int8") or h in a.heads.split(",")]
    heads += [h + UNFUSED for h in heads] if a.unfused else []
    from pdcore.config import ServerArgs
    from pdcore.engine import native
    from pdcore.runtime.llm_engine import LLMEngine

    name = f"{NAME}_{a.tag}" if a.tag else NAME
    run = Run(name, vars(a))
    engines, parts = {}, {}
    try:
        for head in heads:
            os.environ["PDCORE_W8A8_LM_HEAD"] = head.removesuffix(UNFUSED)  # read at load
            engines[head] = LLMEngine(ServerArgs(
                model_path=a.model_path, max_total_tokens=a.batch * (a.ctx + a.steps + 128),
                disable_radix_cache=True, log_level="warning"))
            unfuse(engines[head], head)
            parts[head] = Parts(engines[head], a.batch, a.ctx, a.steps)
        samples: dict[str, dict[str, list[float]]] = {h: {} for h in heads}
        bandwidth = []
        for r in range(a.iters):
            bandwidth.append(_bandwidth())
            for head in alternating(heads, r):
                parts[head].once(samples[head], a.new)
    finally:
        for e in engines.values():
            e.close()
    bw = statistics.median(bandwidth)
    body = sum(parts["int8"].kind_bytes.values())
    stored = body + parts["float"].head_bytes
    int8_only = body + parts["int8"].head_bytes
    floors = {"as_stored": {"bytes": stored, "ms": 1e3 * stored / bw},
              "int8": {"bytes": int8_only, "ms": 1e3 * int8_only / bw}}
    result: dict[str, Any] = {"int8_gemm": native.INT8_PATHS[native.int8_path()],
                              "bandwidth_gb_s": bw / 1e9,
                              "bandwidth_gb_s_rounds": [b / 1e9 for b in bandwidth],
                              "body_bytes": {k: v for k, v in parts["int8"].kind_bytes.items()},
                              "lm_head_bytes": {h: parts[h].head_bytes for h in heads},
                              "floor": floors, "heads": {}}
    for head in heads:
        m = {k: statistics.median(v) for k, v in samples[head].items()}
        gemms = sum(m[f"gemm_{k}"] for k in KINDS)
        m["body_gemms"] = gemms
        m["attention_and_rest"] = m["layers"] - gemms
        m["norm_and_logits"] = m["forward"] - m["layers"]
        m["python_and_scheduler"] = m["engine_step"] - m["forward"] - m["sampler_greedy"]
        m["body_gemm_gb_s"] = body / gemms / 1e6
        m["lm_head_gb_s"] = parts[head].head_bytes / m["lm_head"] / 1e6
        m["tpot_over_floor"] = {f: m["engine_step"] / floors[f]["ms"] for f in floors}
        result["heads"][head] = {"ms": m, "rounds": samples[head]}
    result["note"] = load_note(run)
    path = run.finish(result)
    print(f"read bandwidth {bw / 1e9:.1f} GB/s; int8 GEMM {result['int8_gemm']}; floors: as "
          f"stored {stored / 1e6:.0f} MB {floors['as_stored']['ms']:.2f} ms, int8 "
          f"{int8_only / 1e6:.0f} MB {floors['int8']['ms']:.2f} ms")
    for head in heads:
        m = result["heads"][head]["ms"]
        print(f"lm_head {head}: " + ", ".join(
            f"{k} {m[k]:.2f}" for k in ("body_gemms", "attention_and_rest", "lm_head",
                                        "norm_and_logits", "forward", "sampler_greedy",
                                        "sampler_t1", "python_and_scheduler", "engine_step"))
              + f" ms; TPOT/floor as stored {m['tpot_over_floor']['as_stored']:.2f}x, int8 "
              f"{m['tpot_over_floor']['int8']:.2f}x")
    fig, (ax,) = figure(1, width=7)
    stack = ("body_gemms", "attention_and_rest", "norm_and_logits", "sampler_greedy",
             "python_and_scheduler")
    for i, head in enumerate(heads):
        m, bottom = result["heads"][head]["ms"], 0.0
        for j, k in enumerate(stack):
            ax.bar(i, m[k], bottom=bottom, color=f"C{j}", label=k if i == 0 else None)
            bottom += m[k]
    for f, style in (("as_stored", "--"), ("int8", ":")):
        ax.axhline(floors[f]["ms"], ls=style, color="k", label=f"floor {f}")
        ax.axhline(1.6 * floors["int8"]["ms"], ls="-.", color="r",
                   label="1.6x int8 floor") if f == "int8" else None
    ax.set_xticks(range(len(heads)), [f"lm_head {h}" for h in heads])
    ax.set_ylabel(f"ms per decode step, batch {a.batch}")
    ax.set_title(f"W8A8 decode step ({result['note']})", fontsize=9)
    ax.legend(fontsize=7)
    print(save_figure(fig, name), path)


if __name__ == "__main__":
    main()
