"""How close a quantized model is to its float32 original (#48 item 4): over a fixed set of
texts (bench/quant_accuracy_texts.txt, 3110 scored positions), the top-1 agreement of
next-token predictions (every position of every text, teacher forced) and the perplexity of
each, with their difference.

Every format runs in pdserve's own engine (LLMEngine, in process, its real loader detecting the
format from the checkpoint's files) over the same token ids. The float32 model is the default
SmolLM2-135M's float32 HF folder (its GGUF cache: the packaged Q4_1 file de-quantized, the only
float weights there are without a model hub). The quantized checkpoints are made from it here
(pdcore/testing/quant_models.py): compressed-tensors W8A8 (compressed-tensors' own qparams and
quantize; SmoothQuant and GPTQ as llmcompressor's W8A8 recipe runs them; a layer left float is
named in the config's `ignore` list), DeepSeek-V3-layout FP8 (e4m3, 128x128 block scales;
rounded to nearest or by GPTQ), a Q8_0 GGUF written with the `gguf` package (de-quantized at
load or served packed) and the packaged Q4_1 served packed (FORMATS lists them). The prompt
logprobs (logprob_start_len 0, top 1) give every position's top-1 token and the logprob of the
text's own next token.

Run: `python bench/quant_accuracy.py [--model-path FLOAT_HF_FOLDER] [--formats a,b]
[--work DIR]`; JSON + PNG in bench/results/quant_accuracy.*; CPU flags and load in the JSON.
With --work the checkpoints and each format's scores stay in DIR, so a run can be split
(`--score-only --formats ...` in pieces, then one run that reads them all).
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
LM_HEAD_ENV = "PDCORE_W8A8_LM_HEAD"
# the fixed text set (bench/quant_accuracy_texts.txt, written for this bench): 36 passages of
# prose, dialogue, instructions, a letter, Python, SQL, shell and JSON; 3110 scored positions
# with SmolLM2's tokenizer, so one token is 0.03% of the agreement
TEXTS = (Path(__file__).resolve().parent / "quant_accuracy_texts.txt").read_text(
    encoding="utf-8").split("\n----\n")


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


def _score(model_path: str, prompts: list[list[int]], dtype: str = "auto",
           env: dict[str, str] | None = None) -> list[list[tuple[float, int]]]:
    """Per text, per position 1..n-1: (logprob of the text's token, top-1 token id), from
    pdserve's engine serving `model_path` (its own loader: the checkpoint's format detected from
    its files) with `env` set around the load."""
    import os

    from pdcore.config import ServerArgs
    from pdcore.engine import native
    from pdcore.messages.io import SamplingParams
    from pdcore.runtime.llm_engine import LLMEngine

    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    native._state.pop("gguf", None)  # the packed GEMM's path is chosen once a process: again
    try:  # `env` stays set through the scoring
        eng = LLMEngine(ServerArgs(model_path=model_path, dtype=dtype, max_total_tokens=8192,
                                   disable_radix_cache=True, skip_server_warmup=True))
        try:
            outs = eng.generate(prompts, SamplingParams(max_new_tokens=1, temperature=0.0),
                                return_logprob=True, logprob_start_len=0, top_logprobs_num=1)
        finally:
            eng.close()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        native._state.pop("gguf", None)
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


# every format: (what it is, how its checkpoint is made and served). The makers take (src: the
# float HF folder, dst: a folder to write, calib: calibration token lists, gguf: the packaged
# GGUF file) and return (model path, dtype, environment).
FORMATS: dict[str, str] = {
    "float32": "the reference: the float32 HF folder (the packaged Q4_1 GGUF de-quantized)",
    "bf16": "the same folder served with --dtype bfloat16",
    "w8a8 rtn": "compressed-tensors W8A8 int8, weights rounded to nearest",
    "w8a8 sq": "W8A8 after SmoothQuant 0.8 on q/k/v and gate/up (llmcompressor's W8A8 recipe "
               "smooths first)",
    "w8a8 sq+down gptq": "W8A8, SmoothQuant 0.8 on q/k/v, gate/up and 0.5 on down_proj (from "
                         "up_proj), GPTQ rounding",
    "w8a8 sq gptq down_proj float": "W8A8, SmoothQuant 0.8 + GPTQ, down_proj left float by "
                                       "the checkpoint's ignore list (re:.*down_proj$)",
    "w8a8 rtn + int8 lm_head": "w8a8 rtn with its float lm_head quantized to int8 at load "
                              "(per output channel, compressed-tensors' qparams; "
                              "PDCORE_W8A8_LM_HEAD=int8)",
    "w8a8 sq gptq down_proj float + int8 lm_head": "that best W8A8 with the int8 lm_head",
    "w8a8 rtn + bf16 lm_head": "w8a8 rtn with its float lm_head's weights rounded to bf16 at "
                              "load, float32 activations (PDCORE_W8A8_LM_HEAD=bf16)",
    "w8a8 sq gptq down_proj float + bf16 lm_head": "that best W8A8 with the bf16 lm_head",
    "w8a8 rtn + bf16_dot lm_head": "w8a8 rtn with the bf16 lm_head's weights and its input "
                                  "rounded to bf16, bf16 dot products, float32 logits "
                                  "(PDCORE_W8A8_LM_HEAD=bf16_dot; AVX-512 BF16)",
    "w8a8 sq gptq down_proj float + bf16_dot lm_head": "that best W8A8 with the bf16_dot "
                                                       "lm_head",
    "fp8 block rtn": "FP8 e4m3 weights, 128x128 block scales (DeepSeek-V3 layout), rounded to "
                     "nearest; activations float",
    "fp8 block gptq": "FP8 e4m3 weights, 128x128 block scales, GPTQ rounding to the e4m3 grid",
    "gguf q8_0": "a Q8_0 GGUF made with the gguf package from the float weights, de-quantized "
                 "at load (PDCORE_GGUF_PACKED=0)",
    "gguf q8_0 packed": "that Q8_0 GGUF served packed, float activations (PDCORE_GGUF_DOT=float)",
    "gguf q4_1 packed": "the packaged Q4_1 GGUF served packed, the default integer dot "
                        "(PDCORE_GGUF_DOT=int8: activations rounded to int8 per block of 32; the "
                        "reference is the file's own de-quantization: this row measures the "
                        "packed kernels)",
    "gguf q4_1 packed float": "the same, float activations against the de-quantized blocks "
                              "(PDCORE_GGUF_DOT=float)",
}


def _make_plain(name: str, src: str, out: str, calib: list[list[int]],
                samples) -> tuple[str, str, dict[str, str]]:  # type: ignore[no-untyped-def]
    """The W8A8 checkpoints (their lm_head float, as llmcompressor leaves it)."""
    from pdcore.testing.quant_models import make_w8a8_model

    if name == "w8a8 rtn":
        return make_w8a8_model(src, out), "float32", {}
    if name == "w8a8 sq":
        return make_w8a8_model(src, out, calibration=calib), "float32", {}
    if name == "w8a8 sq+down gptq":
        return make_w8a8_model(src, out, calibration=calib + samples(), alpha_down=0.5,
                               gptq=True), "float32", {}
    if name == "w8a8 sq gptq down_proj float":
        return make_w8a8_model(src, out, calibration=calib + samples(), gptq=True,
                               keep_float=("down_proj",)), "float32", {}
    raise KeyError(name)


def _make(name: str, src: str, dst: Path, calib: list[list[int]], gguf: str,
          samples) -> tuple[str, str, dict[str, str]]:  # type: ignore[no-untyped-def]
    from pdcore.testing.quant_models import make_fp8_model, make_gguf_q8_0

    out = str(dst)
    packed = {"PDCORE_GGUF_PACKED": "1", "PDCORE_GGUF_DOT": "int8"}
    packed_float = {**packed, "PDCORE_GGUF_DOT": "float"}
    head = name.rsplit(" + ", 1)[-1] if name.endswith(" lm_head") else None
    if head is not None:  # the same checkpoint as the format it names, its lm_head so
        base, how = name[: -len(" + " + head)], head.split()[0]
        base_dst = dst.with_name(base.replace(" ", "_"))
        if (base_dst / "config.json").is_file():
            return str(base_dst), "float32", {LM_HEAD_ENV: how}
        path, dtype, _ = _make(base, src, base_dst, calib, gguf, samples)
        return path, dtype, {LM_HEAD_ENV: how}
    if name.startswith("w8a8"):  # as the checkpoint stores the lm_head: float
        path, dtype, _ = _make_plain(name, src, out, calib, samples)
        return path, dtype, {LM_HEAD_ENV: "float"}
    if name == "float32":
        return src, "float32", {}
    if name == "bf16":
        return src, "bfloat16", {}
    if name == "fp8 block rtn":
        return make_fp8_model(src, out), "float32", {}
    if name == "fp8 block gptq":
        return make_fp8_model(src, out, calibration=calib + samples()), "float32", {}
    q8 = dst.parent / "q8_0" / (Path(gguf).name.replace("Q4_1", "Q8_0"))
    if name.startswith("gguf q8_0") and not q8.exists():
        q8.parent.mkdir(parents=True, exist_ok=True)
        make_gguf_q8_0(gguf, str(q8) + ".tmp")
        Path(str(q8) + ".tmp").rename(q8)
    if name == "gguf q8_0":
        return str(q8), "float32", {"PDCORE_GGUF_PACKED": "0"}
    if name == "gguf q8_0 packed":
        return str(q8), "float32", packed_float
    if name == "gguf q4_1 packed":
        return gguf, "float32", packed
    if name == "gguf q4_1 packed float":
        return gguf, "float32", packed_float
    raise KeyError(name)


def _rows(name: str, work: Path, build) -> list:  # type: ignore[no-untyped-def]
    """The format's scores, from `work` when an earlier run of this bench left them there."""
    import json

    cache = work / "scores" / (name.replace(" ", "_").replace(",", "") + ".json")
    if cache.exists():
        return json.loads(cache.read_text())
    rows = build()
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(rows))
    return rows


def main() -> None:
    import json
    import os

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", default=None,
                    help="float HF folder (default: the default model's float32 GGUF cache)")
    ap.add_argument("--formats", default=",".join(FORMATS),
                    help=f"comma-separated subset of: {', '.join(FORMATS)}")
    ap.add_argument("--work", default=None,
                    help="folder for the checkpoints and each format's scores, kept between runs "
                         "(a run skips the formats already scored there; default: a temporary "
                         "folder)")
    ap.add_argument("--tag", default=None, help="results in quant_accuracy_<tag>.json / .png")
    ap.add_argument("--score-only", action="store_true",
                    help="score the formats into --work, write no result")
    args = ap.parse_args()
    from pdcore.engine.model.gguf_cache import converted
    from pdcore.engine.model.source import resolve_model
    from pdcore.engine.model.tokenizer import load_tokenizer

    names = [n.strip() for n in args.formats.split(",") if n.strip()]
    bad = [n for n in names if n not in FORMATS]
    if bad:
        ap.error(f"--formats: unknown {bad}; known: {', '.join(FORMATS)}")
    packaged = resolve_model(None)
    gguf = os.path.join(packaged.path, packaged.gguf_file or "")
    src = args.model_path or converted(packaged).path
    tok = load_tokenizer(argparse.Namespace(model_path=src))
    prompts = [tok.encode(t) for t in TEXTS]
    calib = [tok.encode(t) for t in CALIBRATION]
    got: list = []

    def samples() -> list[list[int]]:  # GPTQ needs more inputs than 4 texts: 8 x 127 tokens
        if not got:  # the float model wrote (temperature 1, seeded)
            got.extend(_samples(src, 8, 127))
        return got

    res_name = f"{NAME}_{args.tag}" if args.tag else NAME
    run = Run(res_name, {"model": src, "texts": len(TEXTS), "calibration_texts": len(CALIBRATION),
                     "formats": {n: FORMATS[n] for n in names}})
    tmp = tempfile.TemporaryDirectory(prefix="pdserve-quant-acc-")
    work = Path(args.work or tmp.name)
    # a GGUF's float conversion goes to pdserve's usual cache (gguf_cache.py), where the packaged
    # Q4_1's already is: converting it again under a loaded machine outran the cache's 900 s lock
    scores = {}
    order = names if args.score_only else ["float32"] + [n for n in names if n != "float32"]
    for name in order:
        def build(name: str = name) -> list:  # type: ignore[no-untyped-def]
            path, dtype, env = _make(name, src, work / "ckpt" / name.replace(" ", "_"), calib,
                                     gguf, samples)
            return _score(path, prompts, dtype, env)
        scores[name] = _rows(name, work, build)
        print(f"{name}: scored ({load_note(run)})", flush=True)
    if args.score_only:
        return
    ref = scores["float32"]
    result: dict[str, Any] = {"formats": {}}
    for name, rows in scores.items():
        if [len(r) for r in rows] != [len(r) for r in ref]:
            raise SystemExit(f"{name}: scored other positions than float32 (tokenizer?)")
        same = sum(a[1] == b[1] for ra, rb in zip(rows, ref) for a, b in zip(ra, rb))
        m = _metrics(rows)
        m["top1_agreement"] = same / m["tokens"]
        m["perplexity_diff"] = m["perplexity"] - _metrics(ref)["perplexity"]
        result["formats"][name] = m
        print(f"{name}: top-1 agreement {m['top1_agreement']:.4f} over {m['tokens']} positions, "
              f"perplexity {m['perplexity']:.3f} ({m['perplexity_diff']:+.3f})", flush=True)
    result["note"] = load_note(run)
    print(run.finish(result))
    fig, (a1, a2) = figure(2, width=7.0)
    names = list(result["formats"])
    a1.barh(names, [100 * result["formats"][n]["top1_agreement"] for n in names])
    a1.set_xlim(85, 100.5)
    for bar, colour in ((97, "tab:blue"), (98, "tab:orange"), (99, "tab:green")):
        a1.axvline(bar, ls="--", color=colour, lw=0.8)
    a1.invert_yaxis()
    a1.tick_params(axis="y", labelsize=7)
    a1.set_xlabel(f"top-1 agreement with float32 (%), {result['formats']['float32']['tokens']} "
                  "positions")
    a2.barh(names, [result["formats"][n]["perplexity_diff"] for n in names])
    a2.invert_yaxis()
    a2.set_yticks([])
    a2.set_xlabel("perplexity - float32's")
    fig.suptitle(f"{Path(src).name}: quantized vs float32 ({result['note']})", fontsize=9)
    fig.tight_layout()
    print(save_figure(fig, res_name))
    tmp.cleanup()


if __name__ == "__main__":
    main()
