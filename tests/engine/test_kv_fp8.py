"""--kv-cache-dtype fp8_e4m3 / fp8_e5m2 (engine/kv/fp8.py): the pool stores one byte a value.
In-process engines on the tiny random Llama (float32 weights), one per KV dtype:
- the same memory budget (--mem-fraction-static) holds twice bf16's tokens, from the engines'
  own numbers (EngineInfo.max_total_tokens, kv_bytes_per_token);
- the pool's tensors are FP8 and prefill wrote them (not zeros);
- FP8-KV greedy agrees with bf16-KV greedy on most tokens (printed with -s; not asserted
  equal: FP8 keeps 3 or 2 bits of mantissa);
- quantize / de-quantize with a scale (the checkpoint's k_scale / v_scale) round-trip, and an
  out-of-range value saturates instead of turning into NaN.
The 1P1D run and the handshake refusal: tests/server/test_flags_pd.py."""

from __future__ import annotations

import pytest
import torch

from pdcore.engine import native
from pdcore.engine.kv.fp8 import dequantize, quantize, store_rows

NEW = 16
BUDGET = 8 << 20  # KV bytes each engine gets beside its weights


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 40000, (n,), generator=g).tolist() for n in (5, 17, 33, 64)]


@pytest.fixture(scope="module")
def runs(tiny_llama_dir):
    from safetensors import safe_open

    from pdcore.builtin.platforms import CpuPlatform
    from pdcore.config import ServerArgs
    from pdcore.messages.io import SamplingParams
    from pdcore.runtime.llm_engine import LLMEngine

    total = CpuPlatform().memory_info(torch.device("cpu")).total_bytes
    weights = 0
    for f in tiny_llama_dir.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            weights += sum(st.get_tensor(k).numel() * 4 for k in st.keys())  # float32 weights
    frac = (weights + BUDGET) / total
    greedy = SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)
    out = {}
    for kd in ("bfloat16", "fp8_e4m3"):  # e5m2: the same code with the other dtype
        eng = LLMEngine(ServerArgs(model_path=str(tiny_llama_dir), kv_cache_dtype=kd,
                                   mem_fraction_static=frac, max_running_requests=8,
                                   disable_radix_cache=True, log_level="warning"))
        try:
            e = eng.engine
            k0 = e.kv.layers[0][0]
            written = int((k0.view(torch.uint8) != 0).sum()) if k0.element_size() == 1 else -1
            ids = [o["output_ids"] for o in eng.generate(_prompts(), greedy)]
            if k0.element_size() == 1:
                written = int((k0.view(torch.uint8) != 0).sum()) - written
            out[kd] = {"info": e.info, "pool_dtype": k0.dtype, "ids": ids, "written": written,
                       "native_steps": e.model.native_steps}
        finally:
            eng.close()
    return out


def test_checkpoint_scales_are_applied_on_write_and_read(tiny_llama_dir, tmp_path, runs) -> None:
    """A checkpoint with k_scale / v_scale 0.5 in every layer (a power of two: K/V x 2 stays
    in e4m3's range and keeps its mantissa): the greedy tokens are the unscaled FP8 run's
    (a scale applied on one side only would change them), through the torch path."""
    import shutil

    from safetensors.torch import load_file, save_file

    from pdcore.config import ServerArgs
    from pdcore.messages.io import SamplingParams
    from pdcore.runtime.llm_engine import LLMEngine

    dest = tmp_path / "scaled"
    shutil.copytree(tiny_llama_dir, dest)
    (f,) = dest.glob("*.safetensors")
    sd = load_file(str(f))
    layers = {k.split(".")[2] for k in sd if k.startswith("model.layers.")}
    for i in layers:
        for x in "kv":
            sd[f"model.layers.{i}.self_attn.{x}_scale"] = torch.tensor(0.5)
    save_file(sd, str(f), metadata={"format": "pt"})
    eng = LLMEngine(ServerArgs(model_path=str(dest), kv_cache_dtype="fp8_e4m3",
                               max_total_tokens=2048, log_level="warning"))
    try:
        model = eng.engine.model
        assert all(l.self_attn.k_scale == l.self_attn.v_scale == 0.5 for l in model.layers)
        greedy = SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)
        assert [o["output_ids"] for o in eng.generate(_prompts(), greedy)] == \
            runs["fp8_e4m3"]["ids"]
        assert model.native_steps == 0  # scaled: the torch path
    finally:
        eng.close()


def test_fp8_pool_holds_twice_bf16s_tokens_for_the_same_memory(runs) -> None:
    bf16 = runs["bfloat16"]["info"]
    for kd, dtype in (("fp8_e4m3", torch.float8_e4m3fn),):
        info = runs[kd]["info"]
        assert runs[kd]["pool_dtype"] == dtype and info.kv_cache_dtype == str(dtype)[6:]
        assert 2 * info.kv_bytes_per_token == bf16.kv_bytes_per_token
        # floor(B / x) against 2 * floor(B / 2x): at most one page apart
        assert abs(info.max_total_tokens - 2 * bf16.max_total_tokens) <= info.page_size, \
            (info.max_total_tokens, bf16.max_total_tokens)
        assert info.max_total_tokens * info.kv_bytes_per_token <= BUDGET + 1024
        assert runs[kd]["written"] > 0  # prefill and decode wrote FP8 bytes into the pool
        # scale 1.0 (no k_scale in the checkpoint): the native decode loop serves FP8 too
        assert (runs[kd]["native_steps"] > 0) == (native.ops() is not None), native.status()


def test_fp8_kv_greedy_agrees_with_bf16_kv_on_most_tokens(runs) -> None:
    ref = runs["bfloat16"]["ids"]
    for kd in ("fp8_e4m3",):
        ids = runs[kd]["ids"]
        same = sum(a == b for r, o in zip(ref, ids) for a, b in zip(r, o))
        # tokens before the first divergence (after it the contexts differ)
        prefix = sum(next((i for i, (a, b) in enumerate(zip(r, o)) if a != b), len(r))
                     for r, o in zip(ref, ids))
        total = sum(len(r) for r in ref)
        print(f"\n{kd} vs bfloat16 KV greedy: {same}/{total} positions equal, "
              f"{prefix}/{total} before the first divergence")
        assert all(len(o) == NEW for o in ids)
        assert same >= total // 2, (kd, same, total)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_quantize_with_a_scale_round_trips_and_saturates(dtype) -> None:
    x = torch.tensor([[0.5, -3.0, 100.0, 1e9]])
    scale = 4.0
    q = quantize(x, dtype, scale)
    assert q.dtype == dtype
    back = dequantize(q, torch.float32, scale)
    big = torch.finfo(dtype).max * scale
    assert torch.isfinite(back).all() and back[0, 3] == big
    rel = 0.07 if dtype == torch.float8_e4m3fn else 0.13  # half an ulp: 3 / 2 mantissa bits
    assert torch.allclose(back[0, :3], x[0, :3], rtol=rel)
    flat = torch.zeros(6, 2, dtype=dtype)
    store_rows(flat, torch.tensor([4, 1]), torch.tensor([[1.0, 2.0], [-8.0, 0.25]]), scale)
    got = dequantize(flat, torch.float32, scale)
    assert got[4].tolist() == [1.0, 2.0] and got[1].tolist() == [-8.0, 0.25]
    assert (got[[0, 2, 3, 5]] == 0).all()
    # any other pool dtype: the plain cast, scale ignored
    assert quantize(x, torch.bfloat16, scale).dtype == torch.bfloat16
    assert dequantize(x.to(torch.bfloat16), torch.float32, scale)[0, 0] == 0.5


def test_the_checkpoints_kv_scales_are_read_else_one() -> None:
    from pdcore.engine.model.llama import _kv_scale

    p = "model.layers.0.self_attn."
    assert _kv_scale({}, p, "k") == 1.0
    assert _kv_scale({p + "k_scale": torch.tensor(0.5)}, p, "k") == 0.5
    assert _kv_scale({p + "v_proj.output_scale": torch.tensor([0.25])}, p, "v") == 0.25


@pytest.mark.parametrize("dtype,scales", [("fp8_e4m3", None), ("fp8_e4m3", (0.37, 1.9)),
                                          ("fp8_e5m2", (1.9, 0.37))])
def test_fp8_decode_in_place_has_the_views_bits(tmp_path, monkeypatch, dtype, scales) -> None:
    """head_dim 64, two query heads a KV head (the paged decode kernel's shapes), an FP8 pool:
    greedy tokens and logprobs with the decode K/V view (float32 copies of float(x) * scale)
    and without it (PDCORE_DECODE_KV_VIEW_MB=0: the paged kernel reads the pool in place,
    fp8_load.h) are the same bits, alone and in a padded batch; pages freed. Unit scales: the
    native decode loop serves both (without the view it refused FP8 before #48's s13 work);
    scaled: the Python layer loop, its attention in place as well."""
    from safetensors.torch import load_file, save_file

    from pdcore.config import ServerArgs
    from pdcore.env import Env
    from pdcore.messages.io import SamplingParams
    from pdcore.runtime.llm_engine import LLMEngine
    from pdcore.testing.pages import pages_at_rest
    from pdcore.testing.tiny_models import make_tiny_model

    path = make_tiny_model(str(tmp_path / "m"), arch="llama", vocab_size=512, seed=5,
                           hidden=256, heads=4, kv_heads=2)
    if scales is not None:
        (f,) = (tmp_path / "m").glob("*.safetensors")
        sd = load_file(str(f))
        for i in {k.split(".")[2] for k in sd if k.startswith("model.layers.")}:
            sd[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(scales[0])
            sd[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(scales[1])
        save_file(sd, str(f), metadata={"format": "pt"})
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (300, 7, 90)]
    sp = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    runs = {}
    for view in ("default", "0"):
        if view == "0":
            monkeypatch.setenv(Env.pdcore_decode_kv_view_mb.name, "0")
        eng = LLMEngine(ServerArgs(model_path=path, kv_cache_dtype=dtype, max_total_tokens=4096,
                                   log_level="warning"))
        try:
            outs = eng.generate(prompts[:1], sp, return_logprob=True) + \
                eng.generate(prompts, sp, return_logprob=True)
            model = eng.engine.model
            runs[view] = ([o["output_ids"] for o in outs],
                          [[lp[0] for lp in o["output_logprobs"]] for o in outs],
                          model.native_steps)
            assert pages_at_rest(eng.scheduler)
            want = 1.0 if scales is None else float(torch.tensor(scales[0]))  # float32's
            assert model.layers[0].self_attn.k_scale == want
        finally:
            eng.close()
    assert runs["0"][0] == runs["default"][0]
    assert runs["0"][1] == runs["default"][1]  # logprobs: the same floats
    if native.ops() is not None:
        assert (runs["0"][2] > 0) == (scales is None), runs  # unit scales: the native loop
