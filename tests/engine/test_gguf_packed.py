"""GGUF weights served packed (engine/model/gguf_packed.py, engine/native/gguf_gemm.h): the
kernels against the `gguf` package's own de-quantization on random blocks of every packed type,
the fallback without native kernels, and the default model (SmolLM2 Q4_1 with a Q8_0 tied
embedding) served packed against its de-quantized float32 self."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
from gguf.quants import dequantize

from pdcore.engine import native
from pdcore.engine.model import gguf_packed as gp

TYPES = (T.Q8_0, T.Q4_0, T.Q4_1, T.Q4_K, T.Q6_K)


def _half(v: np.ndarray) -> np.ndarray:
    return np.frombuffer(np.asarray(v, np.float16).tobytes(), np.uint8).reshape(*v.shape, 2)


def random_blocks(t: T, n: int, k: int, seed: int = 0) -> np.ndarray:
    """uint8 [n, row bytes]: random quants with scales of a realistic size in the f16 fields
    (random bytes there would be NaNs and 1e4s)."""
    g = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[t]
    raw = g.integers(0, 256, size=(n, k // block * size), dtype=np.uint8)
    b = raw.reshape(n, -1, size)
    u = lambda lo, hi: _half(g.uniform(lo, hi, b.shape[:2]))  # noqa: E731
    if t in (T.Q8_0, T.Q4_0):
        b[..., 0:2] = u(-0.05, 0.05)
    elif t == T.Q4_1:
        b[..., 0:2], b[..., 2:4] = u(0, 0.05), u(-0.3, 0)
    elif t == T.Q4_K:
        b[..., 0:2], b[..., 2:4] = u(0, 0.005), u(0, 0.005)
    elif t == T.Q6_K:
        b[..., 208:210] = u(-0.002, 0.002)
    return raw


@pytest.fixture(scope="module")
def ops():
    if native.ops() is None:
        pytest.skip(f"native kernels unavailable: {native.status()}")
    return native.ops()


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_kernels_equal_the_gguf_packages_dequantize_and_matmul(ops, t: T) -> None:
    n, k = 70, 512  # 70: a last group of 4 rows that is partial
    raw = random_blocks(t, n, k)
    w = gp.typed(torch.from_numpy(raw), int(t))
    ref = torch.from_numpy(dequantize(raw, t).astype(np.float32))
    assert gp.in_features(w) == k
    # the weights themselves: the same bits as the package's
    assert torch.equal(gp.rows(w, torch.arange(n)), ref)
    ids = torch.tensor([[3, 69], [0, 3]])
    assert torch.equal(gp.rows(w, ids), ref[ids])
    g = torch.Generator().manual_seed(1)
    b = torch.randn(n, generator=g)
    for m in (1, 3, 8, 16, 17, 70):  # tiles of 4 rows, a last partial one; two blocks of 64
        x = torch.randn(m, k, generator=g)
        want = x @ ref.T + b
        got = ops.gguf_linear(x, w, n, b)
        # each row as it would come alone: the same bits (batch-invariant, as the panels)
        assert torch.equal(got[-1:], ops.gguf_linear(x[-1:], w, n, b)), (t.name, m)
        tol = 1e-5 * float(want.abs().max()) + 1e-5
        assert (got - want).abs().max() <= tol, (t.name, m)
        assert torch.allclose(gp.linear_fallback(x, w, b), want, atol=tol)
    # other dtypes go through float32 and come back in theirs; leading dims kept
    xb = torch.randn(2, 3, k, generator=g).bfloat16()
    yb = ops.gguf_linear(xb, w, n, None)
    assert yb.dtype == torch.bfloat16 and yb.shape == (2, 3, n)


def test_bad_weights_are_refused(ops) -> None:
    raw = torch.from_numpy(random_blocks(T.Q4_1, 8, 64))
    with pytest.raises(ValueError, match="no packed kernel"):
        gp.typed(raw, int(T.Q5_0))
    w = gp.typed(raw, int(T.Q4_1))
    with pytest.raises(RuntimeError, match="does not match"):
        ops.gguf_linear(torch.randn(1, 32), w, 8, None)
    with pytest.raises(RuntimeError, match="stride 0"):
        ops.gguf_linear(torch.randn(1, 64), raw.unsqueeze(0).clone(), 8, None)
    with pytest.raises(RuntimeError, match="outside"):
        ops.gguf_rows(w, torch.tensor([8]))


@pytest.fixture(scope="module")
def packed_smollm2():
    """The default model loaded with PDCORE_GGUF_PACKED=1 (its GGUF: Q4_1 layers, a Q8_0
    embedding tied to the lm_head)."""
    from pdcore.engine.model.loader import load_model

    mp = pytest.MonkeyPatch()
    mp.setenv("PDCORE_GGUF_PACKED", "1")
    try:
        model, _, resolved = load_model(None, torch.float32, torch.device("cpu"))
    finally:
        mp.undo()
    return model, resolved


def test_the_default_model_loads_packed(packed_smollm2) -> None:
    """Every linear layer and the lm_head hold GGUF blocks; the weights they de-quantize to are
    the float32 model's (the GGUF cache's conversion, made by transformers) to the bit, q/k rows
    in HF's order; the lm_head is the embedding's tensor; a sixth of float32's bytes."""
    from pdcore.engine.model.layers import weight_layouts
    from pdcore.engine.model.loader import weight_bytes
    from pdcore.engine.model.weights import SafetensorsWeights

    model, resolved = packed_smollm2
    n = len(model.layers)
    assert weight_layouts(model) == {"panels": 0, "onednn": 0, "plain": 0, "int8": 0, "fp8": 0,
                                     "gguf": 4 * n + 1}
    assert model.native is not None or native.ops() is None  # the native decode loop takes them
    sd = SafetensorsWeights(resolved.path)  # the float32 conversion of the same file
    for i in (0, n - 1):
        a, m = model.layers[i].self_attn, model.layers[i].mlp
        p = f"model.layers.{i}."
        assert gp.TYPE_NAMES[gp.type_of(a.qkv.packed)] == "Q4_1"
        want = torch.cat([sd[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
        assert torch.equal(gp.dequantize(a.qkv.packed), want)
        assert torch.equal(gp.dequantize(a.o_proj.packed), sd[p + "self_attn.o_proj.weight"])
        want = torch.cat([sd[p + f"mlp.{x}_proj.weight"] for x in ("gate", "up")])
        assert torch.equal(gp.dequantize(m.gate_up.packed), want)
        assert torch.equal(gp.dequantize(m.down.packed), sd[p + "mlp.down_proj.weight"])
    ids = torch.tensor([[0, 17], [49151, 17]])
    assert torch.equal(model.embed_tokens(ids), sd["model.embed_tokens.weight"][ids])
    assert gp.TYPE_NAMES[gp.type_of(model.lm_head_packed)] == "Q8_0"
    assert model.lm_head_packed is model.embed_tokens.packed
    float_bytes = sum(sd[k].numel() * 4 for k in sd.keys())
    assert weight_bytes(model) < float_bytes / 5, (weight_bytes(model), float_bytes)


def test_packed_greedy_equals_transformers(smollm2_greedy_refs) -> None:
    """The 8 prompts through the engine serving the GGUF packed, against transformers running
    the de-quantized float32 weights (tests/conftest.py's shared references): the same weights,
    summed in another order; the same bar as test_greedy_equivalence's float32 engine."""
    from pdcore.config import ServerArgs
    from pdcore.messages.io import SamplingParams
    from pdcore.runtime.llm_engine import LLMEngine
    from pdcore.testing.greedy import check_greedy

    prompts, refs, new = smollm2_greedy_refs
    mp = pytest.MonkeyPatch()
    mp.setenv("PDCORE_GGUF_PACKED", "1")
    try:
        eng = LLMEngine(ServerArgs(max_total_tokens=8192, page_size=16,
                                   chunked_prefill_size=256))
        try:
            outs = eng.generate(prompts, SamplingParams(max_new_tokens=new, temperature=0.0),
                                return_logprob=True)
            assert eng.loop.runner.model.lm_head_packed.dtype == torch.uint8
        finally:
            eng.close()
    finally:
        mp.undo()
    verdicts = [check_greedy(o["output_ids"], r, [lp[0] for lp in o["output_logprobs"]])
                for o, r in zip(outs, refs)]
    assert verdicts.count("identical") >= 7, verdicts
