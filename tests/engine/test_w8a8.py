"""#48: W8A8 INT8 end to end. A compressed-tensors W8A8 checkpoint (made here from a tiny random
Llama with compressed-tensors' own qparams and quantize: pdcore/testing/quant_models.py) loads
with its decoder weights kept int8 (per-output-channel scales; packed for the native int8 GEMM
where it serves, test_native_int8.py), runs int8 x int8 -> int32 GEMMs with per-token
activation scales (decode steps in the native layer loop), and its greedy output equals
transformers running the same quantized math in float (de-quantized weights, the same
per-token activation quantization)."""

from __future__ import annotations

import pytest
import torch

from pdcore.config import ServerArgs
from pdcore.engine.model.layers import ColumnLinear, RowLinear, weight_layouts
from pdcore.engine.model.loader import load_model, weight_bytes
from pdcore.engine.model.quant import Int8Weight, quantize_rows
from pdcore.messages.io import SamplingParams
from pdcore.runtime.llm_engine import LLMEngine
from pdcore.testing.greedy import check_greedy, hf_greedy
from pdcore.testing.quant_models import fake_quant_rows, make_w8a8_model, w8a8_reference

PROMPTS = [[1, 17, 42, 99, 7, 300, 5], [2, 250, 251, 9], list(range(30, 70))]
NEW = 16


@pytest.fixture(scope="module")
def w8a8_dir(tiny_llama_dir, tmp_path_factory) -> str:
    return make_w8a8_model(str(tiny_llama_dir), str(tmp_path_factory.mktemp("w8a8") / "m"))


def test_int8_gemm_is_the_quantized_math():
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-128, 128, (48, 64), dtype=torch.int8, generator=g)
    scale = torch.rand(48, 1, generator=g) / 100
    w = Int8Weight(q, scale)
    x = torch.randn(5, 64, generator=g) * torch.tensor([[1.0], [1e-3], [50.0], [0.0], [1.0]])
    xq, xs = quantize_rows(x)
    assert xq.abs().max() <= 127 and bool((xs[3] == 1) & (xq[3] == 0).all())
    acc = xq.long() @ q.long().t()  # exact integers
    want = acc.double() * xs.double() * scale.double().t()
    torch.testing.assert_close(w(x).double(), want, rtol=1e-6, atol=1e-9)
    ref = fake_quant_rows(x) @ w.dequantized().t()
    torch.testing.assert_close(w(x), ref, rtol=1e-4, atol=1e-5)
    assert w(torch.zeros(0, 64)).shape == (0, 48)
    bf = w(x.bfloat16(), torch.ones(48))
    assert bf.dtype == torch.bfloat16 and bf.shape == (5, 48)


def test_weights_stay_int8(w8a8_dir, tiny_llama_dir, monkeypatch):
    monkeypatch.setenv("PDCORE_W8A8_LM_HEAD", "int8")
    model, cfg, _ = load_model(w8a8_dir, torch.float32, torch.device("cpu"))
    linears = [m for m in model.modules() if isinstance(m, (ColumnLinear, RowLinear))]
    assert linears and all(m.int8 is not None and m.weight.dtype == torch.int8 for m in linears)
    # and the lm_head the checkpoint keeps float (`ignore: ["lm_head"]`, tied to the embedding)
    # quantized at load as compressed-tensors quantizes the body, where PDCORE_W8A8_LM_HEAD=int8
    head = model.lm_head_packed
    assert isinstance(head, Int8Weight) and model.lm_head.dtype == torch.int8
    assert model.lm_head.stride() == (0, 0) and tuple(head.shape) == tuple(model.lm_head.shape)
    assert weight_layouts(model)["int8"] == 4 * cfg.num_hidden_layers + 1
    ct = w8a8_reference(w8a8_dir, str(tiny_llama_dir), int8_lm_head=True).lm_head.weight
    assert torch.equal(head.dequantized(), ct.detach())  # the same int8 values and scales
    native = all(m.int8.packed is not None for m in linears)  # the native int8 GEMM serves
    # then the native decode loop takes the int8 panels too
    assert (model.native is not None) == native
    ref, _, _ = load_model(str(tiny_llama_dir), torch.float32, torch.device("cpu"))
    lin_bytes = sum(m.int8.q.numel() for m in linears) + head.q.numel()
    # one byte a weight: the int8 matrix, or its panels, which carry 8 bytes a channel besides
    # (the scale and the VNNI correction) and pad K to 4 and N to 32; and the float scales
    ints = [m.int8 for m in linears] + [head]
    extra = sum(8 * -(-w.shape[0] // 32) * 32 + 32 * -(-w.shape[0] // 32) * 3
                for w in ints) * native + 4 * sum(w.scale.numel() for w in ints)
    assert weight_bytes(ref) - weight_bytes(model) >= 3 * lin_bytes - extra


def test_the_bf16_lm_head_holds_the_rounded_weights(w8a8_dir, tiny_llama_dir, monkeypatch):
    """PDCORE_W8A8_LM_HEAD=bf16, the default: the float lm_head becomes bf16 panels of its
    weights rounded to nearest (half the bytes), read by the native float panel GEMM; where
    that GEMM does not serve it stays float."""
    from pdcore.engine import native
    from pdcore.engine.model.layers import linear, pack_panels

    monkeypatch.delenv("PDCORE_W8A8_LM_HEAD", raising=False)  # the default
    model, cfg, _ = load_model(w8a8_dir, torch.float32, torch.device("cpu"))
    ref = w8a8_reference(w8a8_dir, str(tiny_llama_dir), bf16_lm_head=True).lm_head.weight
    head = model.lm_head_packed
    if not native.panel_gemm():
        assert model.lm_head.dtype == torch.float32 and head is None
        return
    assert head.dtype == torch.bfloat16 and torch.equal(head, pack_panels(ref.bfloat16()))
    assert model.lm_head.dtype == torch.int8 and model.lm_head.stride() == (0, 0)
    assert weight_layouts(model)["panels"] == 1
    h = torch.randn(3, cfg.hidden_size)
    torch.testing.assert_close(linear(h, model.lm_head, None, head), h @ ref.t(),
                               rtol=1e-5, atol=1e-5)


def _bf16_dot_reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None):
    """(x rounded to bf16) @ (w rounded to bf16)^T (+ b) in float64, and the bound on float32
    summation error over K terms (|x| @ |w|^T, K ulps of the largest partial sum)."""
    xb, wb = x.bfloat16().double(), w.bfloat16().double()
    y = xb @ wb.t() + (0 if b is None else b.double())
    bound = (xb.abs() @ wb.abs().t() + (0 if b is None else b.double().abs())) \
        * x.shape[-1] * 2.0 ** -23
    return y, bound


def test_the_bf16_dot_head_is_the_bf16_rounded_math():
    """linear_bf16_f32 (bf16_head.h): float32 x rounded to bf16, bf16 pair panels, float32
    logits: within float32 summation error of (x rounded) @ (W rounded)^T, not rounded to bf16
    after, a row's bits the same alone as in any batch (tiles of 1-12 rows, more than one tile,
    a partial last panel), with a float32 bias; layers.linear takes it for float32 x."""
    from pdcore.engine.model.layers import linear, pack_panels_bf16, stand_in
    from pdcore.engine.model.loader import bf16_dot_support

    if why := bf16_dot_support():
        pytest.skip(why)
    g = torch.Generator().manual_seed(1)
    n, k = 100, 96
    w = torch.randn(n, k, generator=g) / 8
    x = torch.randn(30, k, generator=g) * torch.logspace(-2, 2, 30)[:, None]
    b = torch.randn(n, generator=g)
    panels = pack_panels_bf16(w.bfloat16())
    op = torch.ops.pdcore_native.linear_bf16_f32
    for rows in (1, 3, 8, 12, 13, 30):
        for bias in (None, b):
            y = op(x[:rows], panels, n, bias)
            assert y.dtype == torch.float32 and y.shape == (rows, n)
            want, bound = _bf16_dot_reference(x[:rows], w, bias)
            assert bool(((y.double() - want).abs() <= bound + 1e-30).all()), rows
    # float32 out: most logits are not bf16 values; unrounded x would miss the bound
    y = op(x, panels, n, None)
    assert (y != y.bfloat16().float()).float().mean() > 0.9
    want, bound = _bf16_dot_reference(x, w)
    assert bool(((x.double() @ w.bfloat16().double().t() - want).abs() > bound).any())
    for r in (0, 7, 29):  # a row alone: the same bits as in the batch of 30
        assert torch.equal(op(x[r : r + 1], panels, n, b)[0], op(x, panels, n, b)[r])
    assert torch.equal(linear(x.view(5, 6, k), stand_in(w), None, panels), y.view(5, 6, n))
    assert torch.equal(op(x.bfloat16(), panels, n, None), y)  # bf16 x: the same
    assert op(x[:0], panels, n, None).shape == (0, n)


def test_the_bf16_dot_head_holds_pair_panels(w8a8_dir, tiny_llama_dir, monkeypatch):
    """PDCORE_W8A8_LM_HEAD=bf16_dot where the CPU has AVX-512 BF16: the float lm_head becomes
    bf16 pair panels of its rounded weights (the bytes of the bf16 head) and the logits are the
    bf16-rounded math in float32."""
    from pdcore.engine.model.layers import linear, pack_panels_bf16
    from pdcore.engine.model.loader import bf16_dot_support

    if why := bf16_dot_support():
        pytest.skip(why)
    monkeypatch.setenv("PDCORE_W8A8_LM_HEAD", "bf16_dot")
    model, cfg, _ = load_model(w8a8_dir, torch.float32, torch.device("cpu"))
    ref = w8a8_reference(w8a8_dir, str(tiny_llama_dir), bf16_lm_head=True).lm_head.weight
    head = model.lm_head_packed
    assert head.dtype == torch.bfloat16 and torch.equal(head, pack_panels_bf16(ref.bfloat16()))
    assert model.lm_head.dtype == torch.int8 and model.lm_head.stride() == (0, 0)
    assert weight_layouts(model)["panels"] == 1
    h = torch.randn(3, cfg.hidden_size)
    want, bound = _bf16_dot_reference(h, ref.detach())
    got = linear(h, model.lm_head, None, head)
    assert got.dtype == torch.float32 and bool(((got.double() - want).abs() <= bound).all())


@pytest.mark.parametrize("lacks", ["cpu_isa_avx2", "cpuinfo_no_bf16", "library_no_bf16"])
def test_the_bf16_dot_head_falls_back_to_the_bf16_one(w8a8_dir, tiny_llama_dir, monkeypatch,
                                                      tmp_path, caplog, lacks):
    """Where the CPU lacks AVX-512 BF16 (PDCORE_CPU_ISA=avx2 forcing it down; an AVX-512 CPU
    without it, a Skylake-SP's flags in PDCORE_CPUINFO; a native library without the bf16 GEMM,
    as the avx2 one) PDCORE_W8A8_LM_HEAD=bf16_dot serves the bf16-weight head, and says so."""
    import logging

    from pdcore.engine import native
    from pdcore.engine.model.layers import pack_panels
    from pdcore.engine.model.loader import bf16_dot_support

    if lacks == "cpu_isa_avx2":
        monkeypatch.setenv("PDCORE_CPU_ISA", "avx2")
    elif lacks == "cpuinfo_no_bf16":
        info = tmp_path / "cpuinfo"
        info.write_text("flags\t\t: fpu sse4_2 avx f16c fma avx2 avx512f avx512dq avx512bw "
                        "avx512vl avx512_vnni\n")
        monkeypatch.setenv("PDCORE_CPUINFO", str(info))
    else:
        native.bf16_gemm()  # resolved first, then answered as the avx2 library answers
        monkeypatch.setitem(native._state, "bf16", False)
    assert bf16_dot_support()
    monkeypatch.setenv("PDCORE_W8A8_LM_HEAD", "bf16_dot")
    with caplog.at_level(logging.INFO, logger="pdcore.engine.model.loader"):
        model, _, _ = load_model(w8a8_dir, torch.float32, torch.device("cpu"))
    assert "the bf16_dot head does not serve here" in caplog.text
    head = model.lm_head_packed
    if not native.panel_gemm():
        assert model.lm_head.dtype == torch.float32 and head is None
        return
    ref = w8a8_reference(w8a8_dir, str(tiny_llama_dir), bf16_lm_head=True).lm_head.weight
    assert head.dim() == 3 and torch.equal(head, pack_panels(ref.bfloat16()))


@pytest.mark.parametrize("head", ["int8", "bf16", "bf16_dot"])
def test_greedy_equals_the_float_reference_of_the_same_math(w8a8_dir, tiny_llama_dir,
                                                            monkeypatch, head):
    """With the int8, bf16 or bf16_dot lm_head (PDCORE_W8A8_LM_HEAD; the float one: the next
    test; bf16_dot's reference rounds the head's input to bf16 where it serves)."""
    from pdcore.engine.model.loader import bf16_dot_support

    monkeypatch.setenv("PDCORE_W8A8_LM_HEAD", head)
    ref = w8a8_reference(w8a8_dir, str(tiny_llama_dir), int8_lm_head=head == "int8",
                         bf16_lm_head=head.startswith("bf16"),
                         bf16_input=head == "bf16_dot" and not bf16_dot_support())
    eng = LLMEngine(ServerArgs(model_path=w8a8_dir, max_total_tokens=1024, page_size=4))
    try:
        outs = eng.generate(PROMPTS, SamplingParams(max_new_tokens=NEW, temperature=0.0,
                                                    ignore_eos=True), return_logprob=True)
        # where the native int8 GEMM serves, the decode steps ran the native layer loop over it
        model = eng.engine.model
        assert (model.native_steps > 0) == (model.native is not None)
        if head == "bf16_dot" and not bf16_dot_support():  # the bf16 dot-product head served
            assert model.lm_head_packed.dim() == 4
    finally:
        eng.close()
    # the logprobs agree to 3e-3 (3e-4 seen with the float lm_head, 1.5e-3 with the int8 one:
    # an activation that sits on a rounding boundary may land one int8 step apart after
    # float32 ops in another order, and one step of the lm_head's input moves every logit);
    # tokens are equal
    verdicts = []
    for prompt, out in zip(PROMPTS, outs):
        verdicts.append(check_greedy(out["output_ids"], hf_greedy(ref, prompt, NEW),
                                     [lp for lp, *_ in out["output_logprobs"]], logprob_tol=3e-3))
    assert verdicts.count("identical") >= 2, verdicts


def test_gptq_rounds_closer_than_nearest_and_smoothing_keeps_the_model(tiny_llama_dir):
    """The calibration tools bench/quant_accuracy.py uses (pdcore/testing/quant_models.py):
    GPTQ's int8 weights give outputs closer to the float layer's than rounding to nearest over
    correlated inputs; SmoothQuant (q/k/v, gate/up and down_proj's inputs) leaves the float
    model's logits as they were."""
    from transformers import AutoModelForCausalLM

    from pdcore.testing.quant_models import gptq_int8, smooth

    g = torch.Generator().manual_seed(3)
    x = torch.randn(512, 64, generator=g) @ torch.randn(64, 64, generator=g)  # correlated
    w = torch.randn(32, 64, generator=g)
    s = w.abs().amax(1, keepdim=True) / 127
    nearest = torch.round(w / s).clamp(-128, 127)
    q = gptq_int8(w, x.t() @ x / x.shape[0], s)
    assert q.dtype == torch.int8 and (q.float() - nearest).abs().max() <= 2
    err = lambda wq: float((x @ (wq * s - w).t()).pow(2).mean())  # noqa: E731
    assert err(q.float()) < 0.8 * err(nearest), (err(q.float()), err(nearest))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    ids = torch.tensor([PROMPTS[2]])
    with torch.inference_mode():
        before = model(ids).logits
        smooth(model, [PROMPTS[0], PROMPTS[1]], 0.8, alpha_down=0.5)
        after = model(ids).logits
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)


def test_a_layer_the_checkpoint_ignores_stays_float(tiny_llama_dir, tmp_path, monkeypatch):
    """A W8A8 checkpoint whose quantization_config `ignore`s down_proj (llmcompressor's
    `ignore: ["re:.*down_proj"]`; bench/quant_accuracy.py's best W8A8) holds down_proj float:
    pdserve keeps those layers float (weights and activations), the others int8, and its greedy
    output equals transformers running that mixed math (vLLM and SGLang honour `ignore` so).
    The lm_head stays float too, as the checkpoint stores it, with PDCORE_W8A8_LM_HEAD=float
    (the float head's math, as the reference runs it)."""
    import json

    monkeypatch.setenv("PDCORE_W8A8_LM_HEAD", "float")
    path = make_w8a8_model(str(tiny_llama_dir), str(tmp_path / "m"), keep_float=("down_proj",))
    with open(f"{path}/config.json", encoding="utf-8") as fh:
        assert "re:.*down_proj$" in json.load(fh)["quantization_config"]["ignore"]
    model, cfg, _ = load_model(path, torch.float32, torch.device("cpu"))
    downs = [layer.mlp.down for layer in model.layers]
    assert all(d.int8 is None and d.weight.dtype == torch.float32 for d in downs)
    assert weight_layouts(model)["int8"] == 3 * cfg.num_hidden_layers
    assert model.lm_head.dtype == torch.float32 and not isinstance(model.lm_head_packed,
                                                                   Int8Weight)
    ref = w8a8_reference(path, str(tiny_llama_dir))
    eng = LLMEngine(ServerArgs(model_path=path, max_total_tokens=1024, page_size=4))
    try:
        outs = eng.generate(PROMPTS, SamplingParams(max_new_tokens=NEW, temperature=0.0,
                                                    ignore_eos=True), return_logprob=True)
    finally:
        eng.close()
    verdicts = [check_greedy(out["output_ids"], hf_greedy(ref, prompt, NEW),
                             [lp for lp, *_ in out["output_logprobs"]], logprob_tol=8e-4)
                for prompt, out in zip(PROMPTS, outs)]
    assert verdicts.count("identical") >= 2, verdicts


@pytest.mark.parametrize("keep_float", [(), ("down_proj",)])
def test_the_fused_int8_inputs_leave_the_decode_steps_bits(w8a8_dir, tiny_llama_dir, tmp_path,
                                                          monkeypatch, keep_float):
    """The native decode loop quantizes qkv's and gate_up's inputs in the add + RMSNorm pass and
    down's in the silu * up pass (int8_act.h); its logprobs equal, to the bit, the loop that
    runs those operators apart (int8_fused off), also where a float down_proj (the
    checkpoint's `ignore`) leaves its input to the separate silu_mul."""
    monkeypatch.setenv("PDCORE_W8A8_LM_HEAD", "float")
    path = w8a8_dir if not keep_float else make_w8a8_model(
        str(tiny_llama_dir), str(tmp_path / "m"), keep_float=keep_float)
    eng = LLMEngine(ServerArgs(model_path=path, max_total_tokens=1024, page_size=4,
                               disable_radix_cache=True))
    try:
        model = eng.engine.model
        if model.native is None:
            pytest.skip("no native decode loop here")
        runs = []
        for fused in (True, False, True):
            model.native["int8_fused"] = fused
            steps = model.native_steps
            outs = eng.generate(PROMPTS, SamplingParams(max_new_tokens=NEW, temperature=0.0,
                                                        ignore_eos=True), return_logprob=True)
            assert model.native_steps > steps
            runs.append([(o["output_ids"], [lp for lp, *_ in o["output_logprobs"]])
                         for o in outs])
    finally:
        eng.close()
    assert runs[0] == runs[1] == runs[2]
