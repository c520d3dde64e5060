"""--dtype bfloat16 on CPU: refused where the CPU lacks native bf16 (exit 2, saying what to use),
and, where it has it, close to float32 on SmolLM2 and the project's prompt set, teacher-forced:
float32 greedy-continues each prompt; both dtypes then score prompt + continuation in one pass.
- top-1 agreement: positions where bf16's most likely next token is float32's (>= 98%);
- mean |logprob diff| of float32's chosen token over the continuation positions (<= 0.05).
Closeness, not identity: bf16 keeps 8 bits of mantissa. The numbers are printed (-s)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pdcore.engine.cpu_features import CPUINFO_ENV, bf16_support

NEW_TOKENS = 24


def test_bf16_is_refused_where_the_cpu_lacks_it(tmp_path: Path) -> None:
    fake = tmp_path / "cpuinfo"
    fake.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f\n\n")
    r = subprocess.run([sys.executable, "-m", "pdcore", "serve", "--dtype", "bfloat16",
                        "--load-format", "dummy"], capture_output=True, text=True, timeout=120,
                       check=False, env={**__import__("os").environ, CPUINFO_ENV: str(fake)})
    assert r.returncode == 2, r.stderr
    assert "needs AMX or AVX-512 BF16" in r.stderr and "--dtype float32" in r.stderr


def _score(engine, seqs: list[list[int]]) -> list[list[tuple[float, int, int]]]:
    """Per sequence, per position p >= 1: (logprob of token p, token p, top-1 token)."""
    from pdcore.messages.io import SamplingParams

    sp = SamplingParams(max_new_tokens=1, temperature=0.0)
    outs = engine.generate(seqs, sp, return_logprob=True, logprob_start_len=0,
                           top_logprobs_num=1)
    return [[(lp, tok, top[0][1]) for lp, tok, top in o["input_logprobs"] if lp is not None]
            for o in outs]


@pytest.mark.skipif(not bf16_support()[0], reason=f"no native bf16 here: {bf16_support()[1]}")
def test_bf16_is_close_to_float32_teacher_forced(smollm2_tokenizer, monkeypatch) -> None:
    from pdcore.config import ServerArgs
    from pdcore.messages.io import SamplingParams
    from pdcore.runtime.llm_engine import LLMEngine
    from pdcore.testing.prompts import prompt_token_ids

    # the GGUF de-quantized at load: only the dtype differs (served packed, PDCORE_GGUF_PACKED=1,
    # both dtypes would round activations to int8 per block, llama.cpp's numerics)
    monkeypatch.setenv("PDCORE_GGUF_PACKED", "0")
    prompts = prompt_token_ids(smollm2_tokenizer)
    scores = {}
    seqs: list[list[int]] = []
    for dtype in ("float32", "bfloat16"):
        eng = LLMEngine(ServerArgs(dtype=dtype, max_total_tokens=8192, disable_radix_cache=True,
                                   log_level="warning"))
        try:
            if not seqs:
                greedy = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0,
                                        ignore_eos=True)
                seqs = [p + o["output_ids"] for p, o in zip(prompts, eng.generate(prompts, greedy))]
            assert eng.engine.info.dtype == dtype and eng.engine.info.kv_cache_dtype == dtype
            scores[dtype] = _score(eng, seqs)
        finally:
            eng.close()
    agree = total = 0
    diffs = []
    for p, f32, b16 in zip(prompts, scores["float32"], scores["bfloat16"]):
        assert len(f32) == len(b16) == len(p) + NEW_TOKENS - 1
        for i, ((lp32, tok, top32), (lp16, tok16, top16)) in enumerate(zip(f32, b16)):
            assert tok == tok16
            agree += top32 == top16
            total += 1
            if i >= len(p) - 1:  # a continuation token: float32's own greedy choice
                assert top32 == tok
                diffs.append(abs(lp32 - lp16))
    agreement, mean_diff = agree / total, sum(diffs) / len(diffs)
    print(f"\nbf16 vs float32, {len(prompts)} prompts, {total} positions: top-1 agreement "
          f"{agreement:.4f}; continuation ({len(diffs)} tokens) mean |logprob diff| "
          f"{mean_diff:.4f}, max {max(diffs):.4f}")
    assert agreement >= 0.98 and mean_diff <= 0.05
