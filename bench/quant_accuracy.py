"""How close a quantized model is to its float32 original (#48 item 3): over a fixed set of
texts, the top-1 agreement of next-token predictions (every position of every text, teacher
forced) and the perplexity of each, with their difference.

Both run in pdserve's own engine (LLMEngine, in process), each over the same token ids: the
float32 model is the default SmolLM2-135M's float32 HF folder (its GGUF cache), the W8A8 one
that folder quantized with compressed-tensors' W8A8 preset (pdcore/testing/quant_models.py:
int8 weights per output channel, int8 activations per token at run time), the FP8 one that
folder in DeepSeek-V3's FP8 layout (quant_models.make_fp8_model: e4m3 weights, one scale per
128x128 block, activations float). The prompt logprobs
(logprob_start_len 0, top 1) give every position's top-1 token and the logprob of the text's
own next token.

Run: `python bench/quant_accuracy.py [--model-path FLOAT_HF_FOLDER]`; JSON + PNG in
bench/results/quant_accuracy.*; CPU flags (avx512_vnni, amx_int8, ...) and load in the JSON.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Run, figure, load_note, save_figure

NAME = "quant_accuracy"
# the fixed text set: plain prose of several kinds (written for this bench)
TEXTS = [
    "The river runs along the edge of the old town, past the mill and under three stone "
    "bridges, before it turns east toward the marshes where herons wait in the reeds.",
    "To bake bread, mix flour, water, salt and yeast, knead the dough until it is smooth, let it "
    "rise for an hour, shape it into a loaf and bake it in a hot oven until the crust is brown.",
    "A prime number has exactly two divisors: one and itself. The first few are 2, 3, 5, 7, 11 "
    "and 13, and there are infinitely many of them, as Euclid showed more than two thousand "
    "years ago.",
    "The meeting was moved to Thursday afternoon because the projector in the main room was "
    "broken, and the team wanted to show the new design to the whole department at once.",
    "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n    return total "
    "/ len(values)\n\nprint(mean([1, 2, 3, 4]))\n",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen. It happens in "
    "the chloroplasts of plant cells, which hold the green pigment chlorophyll.",
    "She opened the letter slowly, read the first line twice, and then sat down by the window "
    "without a word, holding the page as if it might fly away.",
    "In a distributed system, a request may fail because a server is down, a network link is "
    "slow, or a message is lost; good clients retry with a timeout and back off between tries.",
]


# SmoothQuant's calibration texts: others than TEXTS (written for this bench)
CALIBRATION = [
    "Weather reports say the storm will reach the coast tonight, with strong winds and heavy "
    "rain; schools will stay closed tomorrow and the ferry will not run until Monday.",
    "import os\nfor name in sorted(os.listdir('.')):\n    if name.endswith('.txt'):\n        "
    "print(name, os.path.getsize(name))\n",
    "The committee approved the budget after a long debate about road repairs, the library's "
    "opening hours and the price of the new buses for the northern district.",
    "Water boils at one hundred degrees Celsius at sea level, but at lower temperatures high in "
    "the mountains, because the air pressure there is lower.",
]


def _score(model_path: str, prompts: list[list[int]]) -> list[list[tuple[float, int]]]:
    """Per text, per position 1..n-1: (logprob of the text's token, top-1 token id)."""
    from pdcore.config import ServerArgs
    from pdcore.messages.io import SamplingParams
    from pdcore.runtime.llm_engine import LLMEngine

    eng = LLMEngine(ServerArgs(model_path=model_path, max_total_tokens=4096,
                               disable_radix_cache=True, skip_server_warmup=True))
    try:
        outs = eng.generate(prompts, SamplingParams(max_new_tokens=1, temperature=0.0),
                            return_logprob=True, logprob_start_len=0, top_logprobs_num=1)
    finally:
        eng.close()
    rows = []
    for out in outs:
        entries = [e for e in (out["input_logprobs"] or []) if e[0] is not None]
        rows.append([(float(lp), int(top[0][1])) for lp, _tok, top in entries])
    return rows


def _samples(src: str, n: int, length: int) -> list[list[int]]:
    """n token sequences the float model writes from its BOS at temperature 1 (seed 1)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    bos = AutoTokenizer.from_pretrained(src).bos_token_id
    torch.manual_seed(1)
    with torch.inference_mode():
        out = model.generate(torch.full((n, 1), bos if bos is not None else 1), do_sample=True,
                             temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=length,
                             pad_token_id=0)
    return [row.tolist() for row in out]


def _metrics(rows: list[list[tuple[float, int]]]) -> dict[str, float]:
    lps = [lp for r in rows for lp, _ in r]
    return {"tokens": len(lps), "perplexity": math.exp(-sum(lps) / len(lps))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", default=None,
                    help="float HF folder (default: the default model's float32 GGUF cache)")
    args = ap.parse_args()
    from pdcore.engine.model.gguf_cache import converted
    from pdcore.engine.model.source import resolve_model
    from pdcore.engine.model.tokenizer import load_tokenizer
    from pdcore.testing.quant_models import make_fp8_model, make_w8a8_model

    src = args.model_path or converted(resolve_model(None)).path
    tok = load_tokenizer(argparse.Namespace(model_path=src))
    prompts = [tok.encode(t) for t in TEXTS]
    run = Run(NAME, {"model": src, "texts": len(TEXTS), "calibration_texts": len(CALIBRATION),
                     "formats": ["float32", "w8a8_int8 (round to nearest)",
                                 "w8a8_int8 after SmoothQuant 0.8 (llmcompressor's W8A8 recipe "
                                 "smooths first; calibrated on other texts)",
                                 "fp8 (e4m3 weights, 128x128 block scales, weight-only)",
                                 "w8a8_int8 after SmoothQuant 0.8 on q/k/v and gate/up and 0.5 "
                                 "on down_proj (from up_proj), rounded by GPTQ (calibration: "
                                 "the 4 texts + 8 x 127 tokens sampled from the float model)"]})
    calib = [tok.encode(t) for t in CALIBRATION]
    with tempfile.TemporaryDirectory(prefix="pdserve-w8a8-") as tmp:
        plain = make_w8a8_model(src, str(Path(tmp) / "w8a8"))
        smooth = make_w8a8_model(src, str(Path(tmp) / "w8a8-smooth"), calibration=calib)
        fp8 = make_fp8_model(src, str(Path(tmp) / "fp8"))
        # GPTQ needs more inputs than 4 texts: the float model's own text besides (8 samples
        # of 127 tokens at temperature 1, seeded)
        full = make_w8a8_model(src, str(Path(tmp) / "w8a8-smooth-gptq"),
                               calibration=calib + _samples(src, 8, 127),
                               alpha_down=0.5, gptq=True)
        scores = {"float32": _score(src, prompts), "w8a8_int8": _score(plain, prompts),
                  "w8a8_int8 smoothquant": _score(smooth, prompts),
                  "w8a8_int8 smoothquant+down, gptq": _score(full, prompts),
                  "fp8 block 128x128": _score(fp8, prompts)}
    ref = scores["float32"]
    result: dict[str, Any] = {"formats": {}}
    for name, rows in scores.items():
        same = sum(a[1] == b[1] for ra, rb in zip(rows, ref) for a, b in zip(ra, rb))
        m = _metrics(rows)
        m["top1_agreement"] = same / m["tokens"]
        m["perplexity_diff"] = m["perplexity"] - _metrics(ref)["perplexity"]
        result["formats"][name] = m
        print(f"{name}: top-1 agreement {m['top1_agreement']:.4f} over {m['tokens']} positions, "
              f"perplexity {m['perplexity']:.3f} ({m['perplexity_diff']:+.3f})", flush=True)
    result["note"] = load_note(run)
    print(run.finish(result))
    fig, (a1, a2) = figure(2)
    names = list(result["formats"])
    a1.bar(names, [100 * result["formats"][n]["top1_agreement"] for n in names])
    a1.set_ylim(80, 100.5)
    a1.axhline(97, ls="--", color="gray")
    a1.tick_params(axis="x", labelsize=7)
    a2.tick_params(axis="x", labelsize=7)
    a1.set_ylabel("top-1 agreement with float32 (%)")
    a2.bar(names, [result["formats"][n]["perplexity"] for n in names])
    a2.set_ylabel("perplexity over the text set")
    fig.suptitle(f"{Path(src).name}: quantized vs float32 ({result['note']})", fontsize=9)
    print(save_figure(fig, NAME))


if __name__ == "__main__":
    main()
