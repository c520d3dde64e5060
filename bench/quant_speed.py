"""float32 against W8A8 INT8 decode speed, side by side (#48): the same model (default: the
default SmolLM2-135M's float32 HF folder, and that folder quantized with compressed-tensors'
W8A8 preset), each in pdserve's engine in process, at batch 1 and 8: output tokens/s and TPOT,
against each model's weight-streaming floor.

Per round and system (alternating order across rounds): a batch of B prompts of --prompt
tokens, generated once with 1 new token (prefill) and once with 1 + --new tokens (ignore_eos,
greedy); TPOT = (t_long - t_short) / --new, tokens/s = B * --new / (t_long - t_short).

The floor: a decode step reads every GEMM weight once (the linear layers' int8 panels or float
panels, the lm_head: float32 in both, as the W8A8 checkpoint leaves it, or int8 in the system
w8a8_int8_head, PDCORE_W8A8_LM_HEAD=int8) and, at batch 1-8, is
bound by the memory's read bandwidth; bytes / bandwidth is the fastest a step can be. The
bandwidth is measured in each round beside the systems (a sum over a 512 MiB float32 buffer on
the engine's threads, best of 3). The W8A8 engine's int8 GEMM path (native VNNI / AVX2, or
torch) and the CPU's flags are in the JSON. A W8A8 system named with the suffix _op is its twin
whose native decode loop runs each operator in its own parallel region (the loop before
engine/native/team_step.h); one with _unfused its twin whose native decode loop quantizes the
int8 GEMMs' inputs apart from the norm / silu_mul passes that make them (the loop before
engine/native/int8_act.h: before and after in one run); one with the suffix _lonepy (after any
other) is its twin whose lone decode runs the Python loop, decode_group's rule before #48
(batch 1 only; batch 8 is the same code). On a shared box record the load: the numbers are
what the machine gave, not what the code can do.

Run: `python bench/quant_speed.py [--rounds 2] [--new 32]`; JSON + PNG in
bench/results/quant_speed.*.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Run, alternating, bar_groups, figure, load_note, save_figure

NAME = "quant_speed"
# the W8A8 systems: PDCORE_W8A8_LM_HEAD of each
HEADS = {"w8a8_int8": "float", "w8a8_int8_head": "int8", "w8a8_int8_bf16head": "bf16",
         "w8a8_int8_bf16dot": "bf16_dot"}

UNFUSED = "_unfused"  # a system's twin with the native plan's int8_fused off
# a system's twin whose native loop runs each operator in its own parallel region (int8_fused
# 1: the loop before team_step.h, session 13)
PER_OP = "_op"
# a system's twin whose lone decode (batch 1) runs the Python loop: decode_group's rule before
# #48 (a group needs two sequences), set around that twin's calls only
LONE_PY = "_lonepy"


def _base(name: str) -> str:
    return name.removesuffix(LONE_PY).removesuffix(UNFUSED).removesuffix(PER_OP)


@contextlib.contextmanager
def lone_rule(name: str) -> Iterator[None]:
    """For a system named ...LONE_PY: ForwardBatch.decode_group leaves a lone decode alone."""
    if not name.endswith(LONE_PY):
        yield
        return
    from pdcore.engine.model.batch import ForwardBatch

    real = ForwardBatch.decode_group

    def old(self: Any) -> Any:
        g = real(self)
        return g if g is not None and len(g.seqs) >= 2 else None

    ForwardBatch.decode_group = old  # type: ignore[method-assign]
    try:
        yield
    finally:
        ForwardBatch.decode_group = real  # type: ignore[method-assign]


def unfuse(eng: Any, name: str) -> None:
    """For a system named ...UNFUSED: its native decode loop quantizes the int8 GEMMs' inputs
    apart (int8_fused off); exit 2 where it has no native loop to change."""
    stem = name.removesuffix(LONE_PY)
    if not stem.endswith((UNFUSED, PER_OP)):
        return
    plan = eng.engine.model.native
    if plan is None:
        print(f"{name}: this engine has no native decode loop (native kernels off?)",
              file=sys.stderr)
        sys.exit(2)
    plan["int8_fused"] = 1 if stem.endswith(PER_OP) else 0


def _time(eng: Any, batch: int, prompt: int, new: int) -> float:
    from pdcore.messages.io import SamplingParams

    prompts = [[(7 * i + 31 * j) % 5000 + 100 for j in range(prompt)] for i in range(batch)]
    t0 = time.perf_counter()
    eng.generate(prompts, SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True))
    return time.perf_counter() - t0


def _streamed_bytes(model: Any) -> tuple[int, int]:
    """Bytes a decode step reads of the weights: every linear layer's GEMM weight (int8 panels,
    float panels or oneDNN's) and the lm_head's (the embedding is read a few rows a step); and
    the lm_head's part of them."""
    from pdcore.engine.model.layers import ColumnLinear, RowLinear

    def size(t: Any) -> int:
        if hasattr(t, "tensors") and not hasattr(t, "numel"):  # an int8 lm_head (Int8Weight)
            return sum(size(x) for x in t.tensors())
        return t.numel() * t.element_size()

    total = 0
    for m in model.modules():
        if isinstance(m, (ColumnLinear, RowLinear)):
            total += size(m.packed if m.packed is not None else
                          m.int8.matrix() if m.int8 is not None else m.weight)
    head = getattr(model, "lm_head_packed", None)
    head_bytes = size(head if head is not None else model.lm_head)
    return total + head_bytes, head_bytes


def _bandwidth() -> float:
    """Read bandwidth in bytes/s: a sum over 512 MiB of float32, best of 3."""
    import torch

    buf = torch.ones(128 * 2**20)
    best = float("inf")
    for _ in range(4):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return buf.numel() * 4 / best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--w8a8-path", default=None,
                    help="an existing compressed-tensors W8A8 folder (e.g. the one vs_vllm.py "
                         "serves to vLLM) instead of quantizing --model-path afresh")
    ap.add_argument("--systems", default="float32,w8a8_int8",
                    help="of float32, w8a8_int8 (the lm_head float, as stored), "
                         "w8a8_int8_head (PDCORE_W8A8_LM_HEAD=int8), w8a8_int8_bf16head "
                         "(PDCORE_W8A8_LM_HEAD=bf16) and w8a8_int8_bf16dot "
                         "(PDCORE_W8A8_LM_HEAD=bf16_dot); a W8A8 one + '_unfused': its twin with "
                         "the activation quantization apart (the loop before int8_act.h), "
                         "+ '_op': its twin whose native loop runs each operator in its own "
                         "parallel region (the loop before team_step.h); any + '_lonepy': its "
                         "twin whose lone decode runs the Python loop "
                         "(before #48)")
    ap.add_argument("--tag", default=None, help="results in quant_speed_<tag>.json / .png")
    args = ap.parse_args()
    from pdcore.config import ServerArgs
    from pdcore.engine.model.gguf_cache import converted
    from pdcore.engine.model.source import resolve_model
    from pdcore.runtime.llm_engine import LLMEngine
    from pdcore.testing.quant_models import make_w8a8_model

    src = args.model_path or converted(resolve_model(None)).path
    batches = [int(b) for b in args.batches.split(",")]
    res_name = f"{NAME}_{args.tag}" if args.tag else NAME
    run = Run(res_name, {**vars(args), "model": src})
    samples: dict[str, dict[int, list[float]]] = {}
    with tempfile.TemporaryDirectory(prefix="pdserve-w8a8-") as tmp:
        paths = {}
        for k in args.systems.split(","):
            if _base(k) != "float32" and _base(k) not in HEADS:
                ap.error(f"--systems: unknown system {k!r}")  # exit 2
            paths[k] = src if _base(k) == "float32" else args.w8a8_path
        if any(k.startswith("w8a8") for k in paths) and not args.w8a8_path:
            made = make_w8a8_model(src, str(Path(tmp) / "w8a8"))
            paths = {k: made if k.startswith("w8a8") else v for k, v in paths.items()}
        engines = {}
        for k, p in paths.items():  # the W8A8 lm_head as HEADS says (read at load)
            os.environ["PDCORE_W8A8_LM_HEAD"] = HEADS.get(_base(k), "float")
            engines[k] = LLMEngine(ServerArgs(model_path=p, max_total_tokens=4096,
                                              disable_radix_cache=True))
            unfuse(engines[k], k)
        streamed = {k: _streamed_bytes(e.engine.model) for k, e in engines.items()}
        from pdcore.engine import native

        int8_path = native.INT8_PATHS[native.int8_path()]
        bandwidth: list[float] = []
        try:
            for r in range(args.rounds):
                bandwidth.append(_bandwidth())
                for name in alternating(list(paths), r):
                    for b in batches:
                        with lone_rule(name):
                            short = _time(engines[name], b, args.prompt, 1)
                            long = _time(engines[name], b, args.prompt, 1 + args.new)
                        samples.setdefault(name, {}).setdefault(b, []).append(
                            max(long - short, 1e-9) / args.new)
        finally:
            for e in engines.values():
                e.close()
    bw = statistics.median(bandwidth)
    out: dict[str, Any] = {"int8_gemm": int8_path, "bandwidth_gb_s": bw / 1e9,
                           "bandwidth_gb_s_rounds": [b / 1e9 for b in bandwidth],
                           "systems": {}}
    for name, per in samples.items():
        total, head = streamed[name]
        floor = 1e3 * total / bw
        out["systems"][name] = {
            "streamed_mb": total / 1e6, "lm_head_mb": head / 1e6, "floor_tpot_ms": floor,
            **{str(b): {"tpot_ms": 1e3 * statistics.median(v),
                        "tokens_per_s": b / statistics.median(v),
                        "tpot_over_floor": 1e3 * statistics.median(v) / floor,
                        "tpot_ms_rounds": [1e3 * x for x in v]} for b, v in per.items()}}
    out["note"] = load_note(run)
    print(f"read bandwidth {out['bandwidth_gb_s']:.1f} GB/s; W8A8 GEMM: {int8_path}")
    for name, per in out["systems"].items():
        for b in batches:
            m = per[str(b)]
            print(f"{name} batch {b}: TPOT {m['tpot_ms']:.1f} ms ({m['tpot_over_floor']:.2f}x "
                  f"its floor {per['floor_tpot_ms']:.1f} ms: {per['streamed_mb']:.0f} MB a "
                  f"step, lm_head {per['lm_head_mb']:.0f} MB), {m['tokens_per_s']:.1f} tok/s",
                  flush=True)
    print(run.finish(out))
    fig, (a1, a2) = figure(2, width=6)
    names = list(out["systems"])
    bar_groups(a1, [f"batch {b}" for b in batches],
               {n: [out["systems"][n][str(b)]["tokens_per_s"] for b in batches] for n in names},
               "output tokens/s", f"decode speed ({out['note']})")
    bar_groups(a2, [f"batch {b}" for b in batches],
               {n: [out["systems"][n][str(b)]["tpot_ms"] for b in batches] for n in names},
               "TPOT (ms)", f"TPOT and weight-streaming floors ({out['bandwidth_gb_s']:.0f} GB/s)")
    for i, n in enumerate(names):
        a2.axhline(out["systems"][n]["floor_tpot_ms"], ls="--", color=f"C{i}",
                   label=f"{n} floor")
    a2.legend(fontsize=8)
    print(save_figure(fig, res_name))


if __name__ == "__main__":
    main()
