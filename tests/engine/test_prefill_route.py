"""PDCORE_PREFILL_ATTENTION (engine/model/prefill_route.py, #47): on a CPU with AMX a bf16
prefill chunk of at least SDPA_MIN_TOKENS tokens attends through torch's SDPA (AMX tiles), every
other chunk through the native causal kernel; the SDPA route's output is close to the native
kernel's (bf16 tolerance: its rows are not the decode kernel's bits), for a whole prompt, a chunk
after its prefix, GQA and a pool whose slots are out of order; and a tiny bf16 model's greedy
text is the same through either route."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from pdcore.engine import cpu_features, native
from pdcore.engine.model import layers, prefill_route
from pdcore.engine.model.batch import ForwardBatch, SeqSpan
from pdcore.engine.model.llama import LlamaForCausalLM
from pdcore.env import EnvError
from pdcore.runtime_env import ISA_ENV
from pdserve_testing import random_llama

ENV = "PDCORE_PREFILL_ATTENTION"
XEON = "flags\t\t: fpu avx2 fma avx512f avx512bw avx512vl avx512_bf16 amx_bf16 amx_tile\n"
ZEN4 = "flags\t\t: fpu avx2 fma avx512f avx512bw avx512vl avx512_bf16\n"
T = prefill_route.SDPA_MIN_TOKENS
needs_native = pytest.mark.skipif(native.ops() is None, reason="native kernels not built")


@pytest.fixture
def cpu(tmp_path, monkeypatch: pytest.MonkeyPatch):
    """cpu(text): this process reads `text` as its /proc/cpuinfo."""
    monkeypatch.delenv(ISA_ENV, raising=False)
    monkeypatch.delenv(ENV, raising=False)

    def use(text: str) -> pytest.MonkeyPatch:
        info = tmp_path / "cpuinfo"
        info.write_text(text)
        monkeypatch.setenv(cpu_features.CPUINFO_ENV, str(info))
        return monkeypatch
    return use


def test_auto_takes_sdpa_for_bf16_on_amx_only(cpu) -> None:
    mp = cpu(XEON)
    r = prefill_route.choose(torch.bfloat16, "cpu")
    assert (r.mode, r.sdpa_from) == ("auto", T) and "amx_bf16" in r.why
    assert f"SDPA for chunks of >= {T} tokens" in r.describe()
    assert prefill_route.choose(torch.float32, "cpu").sdpa_from == prefill_route.NEVER
    for isa in ("avx512", "avx2"):  # a forced-down ISA hides AMX: as on AMD Zen, native
        mp.setenv(ISA_ENV, isa)
        r = prefill_route.choose(torch.bfloat16, "cpu")
        assert r.sdpa_from == prefill_route.NEVER and "no amx_bf16" in r.why
    mp.delenv(ISA_ENV)
    cpu(ZEN4)
    assert prefill_route.choose(torch.bfloat16, "cpu").sdpa_from == prefill_route.NEVER


def test_the_variable_fixes_the_route(cpu) -> None:
    mp = cpu(ZEN4)
    mp.setenv(ENV, "sdpa")
    assert prefill_route.choose(torch.float32, "cpu").sdpa_from == 2
    assert prefill_route.choose(torch.bfloat16, "cpu").sdpa_from == 2
    cpu(XEON).setenv(ENV, "NATIVE")
    assert prefill_route.choose(torch.bfloat16, "cpu").sdpa_from == prefill_route.NEVER
    assert prefill_route.choose(torch.bfloat16, "cuda").sdpa_from == prefill_route.NEVER
    mp.setenv(ENV, "fast")
    with pytest.raises(EnvError, match=f"{ENV} must be one of auto, native or sdpa; got 'fast'"):
        prefill_route.choose(torch.bfloat16, "cpu")


def test_a_bad_value_exits_2_at_start_up() -> None:
    r = subprocess.run([sys.executable, "-m", "pdcore", "serve", "--load-format", "dummy"],
                       capture_output=True, text=True, timeout=120, check=False,
                       env={**os.environ, ENV: "amx"})
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"{ENV} must be one of auto, native or sdpa; got 'amx'" in r.stderr
    assert "Traceback" not in r.stderr


def _model(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> LlamaForCausalLM:
    """Two layers, GQA (8 query heads over 2 KV heads of 32), weights in `dtype`."""
    model = random_llama(0.1, final_norm=False, vocab_size=300, hidden_size=256,
                         intermediate_size=256, num_hidden_layers=2, num_attention_heads=8,
                         num_key_value_heads=2, max_position_embeddings=1024)
    model.to(dtype)
    monkeypatch.setenv(ENV, "native")
    # plain F.linear: oneDNN packs bf16 weights only on AVX-512 (PDCORE_CPU_ISA=avx2 runs here)
    monkeypatch.setenv(layers.PACKED_GEMM_ENV, "0")
    model.prepare_for_inference()
    return model


def _step(dtype: torch.dtype, cases: list[tuple[int, int]]):
    """One prefill step of sequences (prefix p, chunk n) in a pool whose slots are shuffled; the
    prefixes' K/V already in the pool (random)."""
    g = torch.Generator().manual_seed(1)
    page, pages = 16, sum(p + n for p, n in cases) // 16 + 8
    kv = [tuple(torch.randn(pages, page, 2, 32, generator=g).to(dtype) for _ in range(2))
          for _ in range(2)]
    perm = torch.randperm(pages * page, generator=g)
    seqs, out_slots, positions, off, used = [], [], [], 0, 0
    for p, n in cases:
        slots = perm[used: used + p + n]
        used += p + n
        seqs.append(SeqSpan(off, n, slots))
        out_slots += slots[p:].tolist()
        positions += range(p, p + n)
        off += n
    batch = ForwardBatch(input_ids=torch.randint(3, 300, (off,), generator=g),
                         positions=torch.tensor(positions), out_slots=torch.tensor(out_slots),
                         seqs=seqs, logit_rows=torch.arange(off))
    return batch, kv


def _attention(model: LlamaForCausalLM, cases, sdpa_from: int):
    """Layer 0's attention output (o_proj included) for the step, and the chunks the native
    kernel attended."""
    dtype = model.norm.weight.dtype
    batch, kv = _step(dtype, cases)
    a = model.layers[0].self_attn
    a.sdpa_from = sdpa_from
    with torch.inference_mode():
        h = model.layers[0].input_layernorm(model.embed_tokens(batch.input_ids))
        step = model.begin(h, batch, kv)
        out = a(h, step.cos, step.sin, kv[0][0], kv[0][1], batch)
        model.end(step)
    return out.float(), batch.native_prefill


CASES = {"whole prompt": [(0, 300)], "chunk after a prefix": [(400, 280)],
         "three in one step": [(0, 260), (300, 270), (100, T - 2)], "short": [(0, T - 4)],
         "short after a prefix": [(300, T - 1)]}


@needs_native
@pytest.mark.parametrize("case", list(CASES))
def test_the_sdpa_route_is_close_to_the_native_kernel(case, monkeypatch) -> None:
    model = _model(torch.bfloat16, monkeypatch)
    cases = CASES[case]
    want, took = _attention(model, cases, prefill_route.NEVER)
    assert took == len(cases)  # the native kernel attended every chunk
    got, took = _attention(model, cases, T)
    assert took == sum(n < T for _, n in cases)  # chunks of >= T tokens took SDPA
    err = (got - want).abs().max().item()
    assert err <= 2e-2 * want.abs().max().item(), (case, err)
    if case.startswith("short"):
        assert torch.equal(got, want)  # a short chunk stays native: the same bits


@needs_native
def test_a_float32_model_stays_native_and_sdpa_is_close(monkeypatch) -> None:
    model = _model(torch.float32, monkeypatch)
    cases = CASES["three in one step"]
    assert all(la.self_attn.sdpa_from == prefill_route.NEVER for la in model.layers)
    want, took = _attention(model, cases, prefill_route.NEVER)
    got, took2 = _attention(model, cases, 2)  # what PDCORE_PREFILL_ATTENTION=sdpa sets
    assert (took, took2) == (3, 0)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_the_route_is_set_at_load(cpu) -> None:
    mp = cpu(XEON)
    model = _model(torch.bfloat16, mp)  # pinned native
    assert {la.self_attn.sdpa_from for la in model.layers} == {prefill_route.NEVER}
    mp.setenv(ENV, "auto")
    assert prefill_route.apply(model).sdpa_from == T
    assert {la.self_attn.sdpa_from for la in model.layers} == {T}
    mp.setenv(ISA_ENV, "avx512")
    assert prefill_route.apply(model).sdpa_from == prefill_route.NEVER


@needs_native
@pytest.mark.skipif(not cpu_features.bf16_support()[0], reason="no bf16 hardware")
def test_greedy_text_is_the_same_through_either_route(tiny_llama_dir, monkeypatch) -> None:
    """A tiny bf16 model, a 300-token prompt in one chunk: greedy tokens through SDPA (auto on
    an AMX host, `sdpa` elsewhere) equal the native kernel's."""
    from pdcore.config import ServerArgs
    from pdcore.messages.io import SamplingParams
    from pdcore.runtime.llm_engine import LLMEngine

    prompt = [(i * 7919) % 40000 + 100 for i in range(300)]
    sp = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    amx = "amx_bf16" in cpu_features.cpu_flags()
    texts, chunks = {}, {}
    for mode in ("native", "auto" if amx else "sdpa"):
        monkeypatch.setenv(ENV, mode)
        eng = LLMEngine(ServerArgs(model_path=str(tiny_llama_dir), dtype="bfloat16",
                                   max_total_tokens=4096, log_level="warning"))
        try:
            model = eng.loop.runner.model
            out = eng.generate([prompt], sp)
            chunks[mode] = model.native_prefill_chunks
        finally:
            eng.close()
        texts[mode] = out[0]["output_ids"]
    (a, ta), (b, tb) = texts.items()
    assert chunks["native"] > 0 and chunks[b] == 0, chunks
    assert ta == tb, texts
