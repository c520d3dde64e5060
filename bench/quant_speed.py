"""float32 against W8A8 INT8 decode speed, side by side (#48): the same model (default: the
default SmolLM2-135M's float32 HF folder, and that folder quantized with compressed-tensors'
W8A8 preset), each in pdserve's engine in process, at batch 1 and 8: output tokens/s and TPOT.

Per round and system (alternating order across rounds): a batch of B prompts of --prompt
tokens, generated once with 1 new token (prefill) and once with 1 + --new tokens (ignore_eos,
greedy); TPOT = (t_long - t_short) / --new, tokens/s = B * --new / (t_long - t_short). The
machine's load is recorded: on a shared box the numbers are a first look, not a result.

Run: `python bench/quant_speed.py [--rounds 2] [--new 32]`; JSON + PNG in
bench/results/quant_speed.*.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Run, alternating, bar_groups, figure, load_note, save_figure

NAME = "quant_speed"


def _time(eng: Any, batch: int, prompt: int, new: int) -> float:
    from pdcore.messages.io import SamplingParams

    prompts = [[(7 * i + 31 * j) % 5000 + 100 for j in range(prompt)] for i in range(batch)]
    t0 = time.perf_counter()
    eng.generate(prompts, SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True))
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--batches", default="1,8")
    args = ap.parse_args()
    from pdcore.config import ServerArgs
    from pdcore.engine.model.gguf_cache import converted
    from pdcore.engine.model.source import resolve_model
    from pdcore.runtime.llm_engine import LLMEngine
    from pdcore.testing.quant_models import make_w8a8_model

    src = args.model_path or converted(resolve_model(None)).path
    batches = [int(b) for b in args.batches.split(",")]
    run = Run(NAME, {**vars(args), "model": src})
    samples: dict[str, dict[int, list[float]]] = {}
    with tempfile.TemporaryDirectory(prefix="pdserve-w8a8-") as tmp:
        paths = {"float32": src, "w8a8_int8": make_w8a8_model(src, str(Path(tmp) / "w8a8"))}
        engines = {k: LLMEngine(ServerArgs(model_path=p, max_total_tokens=4096,
                                           disable_radix_cache=True))
                   for k, p in paths.items()}
        try:
            for r in range(args.rounds):
                for name in alternating(list(paths), r):
                    for b in batches:
                        short = _time(engines[name], b, args.prompt, 1)
                        long = _time(engines[name], b, args.prompt, 1 + args.new)
                        samples.setdefault(name, {}).setdefault(b, []).append(
                            max(long - short, 1e-9) / args.new)
        finally:
            for e in engines.values():
                e.close()
    out: dict[str, Any] = {"systems": {}}
    for name, per in samples.items():
        out["systems"][name] = {str(b): {"tpot_ms": 1e3 * statistics.median(v),
                                         "tokens_per_s": b / statistics.median(v),
                                         "tpot_ms_rounds": [1e3 * x for x in v]}
                                for b, v in per.items()}
    out["note"] = load_note(run)
    for name, per in out["systems"].items():
        for b, m in per.items():
            print(f"{name} batch {b}: TPOT {m['tpot_ms']:.1f} ms, {m['tokens_per_s']:.1f} tok/s",
                  flush=True)
    print(run.finish(out))
    fig, (ax,) = figure(1, width=6)
    bar_groups(ax, [f"batch {b}" for b in batches],
               {n: [out["systems"][n][str(b)]["tokens_per_s"] for b in batches]
                for n in out["systems"]}, "output tokens/s", f"decode speed ({out['note']})")
    print(save_figure(fig, NAME))


if __name__ == "__main__":
    main()
