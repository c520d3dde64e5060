"""#48: FP8 weights (`--quantization fp8`). Checkpoints in DeepSeek-V3's FP8 layout (float8 e4m3
matrices, `weight_scale_inv` per block, quantization_config {quant_method: fp8,
weight_block_size}) are made here from tiny random models (pdcore/testing/quant_models.py): a
dense Llama with blocks that do not divide its matrices, and a DeepSeek-V3 (MLA + MoE, shared
expert) with the real 128x128 blocks. They load with their matrices -- MoE experts included --
kept FP8 in memory, de-quantized one layer at a time when it computes, and their greedy output
equals transformers running the same de-quantized weights."""

from __future__ import annotations

import pytest
import torch

from pdcore.config import ServerArgs
from pdcore.engine.model.fp8 import Fp8Experts, Fp8Weight
from pdcore.engine.model.layers import ColumnLinear, RowLinear, weight_layouts
from pdcore.engine.model.loader import load_model, weight_bytes
from pdcore.engine.model.quant_config import checked_draft_quantization, checked_quantization
from pdcore.errors import ConfigError
from pdcore.messages.io import SamplingParams
from pdcore.runtime.llm_engine import LLMEngine
from pdcore.testing.greedy import check_greedy, hf_greedy
from pdcore.testing.quant_models import (
    fp8_block_dequantize, fp8_block_quantize, fp8_dequantized_folder, make_fp8_model)
from pdcore.testing.tiny_models import add_mtp_layer, make_tiny_model

NEW = 16


def test_fp8_weight_scales_and_slices():
    """Block, per-channel and per-tensor scales give q * scale; row, column and fused slices keep
    each weight's own blocks."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(50, 70, generator=g) * torch.linspace(0.01, 3, 70)
    q, s = fp8_block_quantize(w, (16, 32))
    assert q.dtype == torch.float8_e4m3fn and s.shape == (4, 3)
    want = fp8_block_dequantize(q, s, (16, 32))
    assert (want - w).abs().max() <= w.abs().max() * 0.07  # e4m3: 3 mantissa bits
    fw = Fp8Weight.from_checkpoint(q, s, (16, 32))
    assert fw.q.dtype == torch.float8_e4m3fn and fw.scale.shape == (50, 3)
    torch.testing.assert_close(fw.dequantized(), want, rtol=0, atol=0)
    torch.testing.assert_close(fw.rows(20, 13).dequantized(), want[20:33], rtol=0, atol=0)
    torch.testing.assert_close(fw.cols(32, 38).dequantized(), want[:, 32:], rtol=0, atol=0)
    with pytest.raises(ValueError, match="cuts"):
        fw.cols(10, 20)
    fused = Fp8Weight.cat([fw.rows(0, 7), Fp8Weight.from_checkpoint(q[:9], s[:1], (16, 32))])
    torch.testing.assert_close(fused.dequantized(), torch.cat([want[:7], want[:9]]), rtol=0,
                               atol=0)
    per_row = torch.rand(50, 1, generator=g)
    torch.testing.assert_close(Fp8Weight.from_checkpoint(q, per_row, None).dequantized(),
                               q.float() * per_row, rtol=0, atol=0)
    torch.testing.assert_close(Fp8Weight.from_checkpoint(q, torch.tensor(0.5), None)
                               .dequantized(torch.bfloat16), (q.float() * 0.5).bfloat16())
    x = torch.randn(3, 70, generator=g)
    torch.testing.assert_close(fw(x, torch.ones(50)), x @ want.t() + 1)
    with pytest.raises(ValueError, match="not per tensor"):
        Fp8Weight.from_checkpoint(q, torch.rand(3, 3), (16, 32))


@pytest.fixture(scope="module")
def dense(tiny_llama_dir, tmp_path_factory):
    """(float folder, FP8 folder with 24x40 blocks, reference folder)."""
    root = tmp_path_factory.mktemp("fp8_dense")
    fp8 = make_fp8_model(str(tiny_llama_dir), str(root / "fp8"), block=(24, 40))
    return str(tiny_llama_dir), fp8, fp8_dequantized_folder(fp8, str(root / "ref"))


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    """The same for a tiny DeepSeek-V3 (one dense layer, two MoE layers) in 128x128 blocks."""
    root = tmp_path_factory.mktemp("fp8_ds3")
    src = add_mtp_layer(make_tiny_model(str(root / "float"), arch="deepseek_v3", layers=3,
                                        seed=5))
    fp8 = make_fp8_model(src, str(root / "fp8"))
    return src, fp8, fp8_dequantized_folder(fp8, str(root / "ref"))


def test_detected_and_checked(dense):
    _, fp8, ref = dense
    assert checked_quantization(None, fp8) == "fp8"
    assert checked_quantization("fp8", fp8) == "fp8"
    with pytest.raises(ConfigError, match="w8a8_int8 does not match .* fp8"):
        checked_quantization("w8a8_int8", fp8)
    with pytest.raises(ConfigError, match="not quantized"):
        checked_quantization("fp8", ref)


def test_weights_stay_fp8(dense):
    src, fp8, _ = dense
    model, cfg, _ = load_model(fp8, torch.float32, torch.device("cpu"))
    linears = [m for m in model.modules() if isinstance(m, (ColumnLinear, RowLinear))]
    assert linears and all(m.fp8 is not None and m.fp8.q.dtype == torch.float8_e4m3fn
                           for m in linears)
    assert weight_layouts(model)["fp8"] == 4 * cfg.num_hidden_layers
    assert model.native is None  # the native decode loop takes float panels only
    ref, _, _ = load_model(src, torch.float32, torch.device("cpu"))
    fp8_bytes = sum(m.fp8.q.numel() for m in linears)
    assert weight_bytes(ref) - weight_bytes(model) >= 3 * fp8_bytes - 4 * sum(
        m.fp8.scale.numel() for m in linears)


def _greedy(path: str, prompts: list[list[int]]) -> list[dict]:
    eng = LLMEngine(ServerArgs(model_path=path, max_total_tokens=2048, page_size=4,
                               chunked_prefill_size=64))
    try:
        return eng.generate(prompts, SamplingParams(max_new_tokens=NEW, temperature=0.0,
                                                    ignore_eos=True), return_logprob=True)
    finally:
        eng.close()


@pytest.mark.parametrize("which", ["dense", "deepseek"])
def test_greedy_equals_transformers_on_the_dequantized_weights(which, request):
    from transformers import AutoModelForCausalLM

    _, fp8, ref_dir = request.getfixturevalue(which)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 37, 90)]
    ref = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    outs = _greedy(fp8, prompts)
    verdicts = [check_greedy(o["output_ids"], hf_greedy(ref, p, NEW),
                             [lp for lp, *_ in o["output_logprobs"]])
                for p, o in zip(prompts, outs)]
    assert verdicts.count("identical") >= 2, verdicts


def test_deepseek_experts_stay_fp8(deepseek):
    _, fp8, _ = deepseek
    model, cfg, _ = load_model(fp8, torch.float32, torch.device("cpu"))
    experts = [m.fp8 for m in model.modules() if isinstance(getattr(m, "fp8", None), Fp8Experts)]
    assert len(experts) == 2  # the two MoE layers
    assert all(len(e.w13) == cfg.n_routed_experts and e.w13[0].q.dtype == torch.float8_e4m3fn
               for e in experts)
    # q_a, q_b, kv_a, o_proj in every layer; the dense MLP's and the shared experts' gate_up
    assert weight_layouts(model)["fp8"] >= 4 * cfg.num_hidden_layers + 3


def test_draft_head_quantization_follows_the_same_rules(deepseek, dense):
    """--speculative-draft-model-quantization: detected from the draft's checkpoint and checked
    like --quantization; the NEXTN head (the FP8 DeepSeek's own MTP layer) loads FP8 with the
    weights the de-quantized checkpoint gives."""
    from pdcore.engine.model.nextn import load_nextn_head

    src, fp8, ref_dir = deepseek
    assert checked_draft_quantization(None, None, fp8) == "fp8"  # NEXTN: the model's own folder
    assert checked_draft_quantization("unquant", None, fp8) == "fp8"  # read as the folder holds
    assert checked_draft_quantization("fp8", dense[1], src) == "fp8"  # a separate draft folder
    assert checked_draft_quantization(None, dense[0], fp8) is None
    with pytest.raises(ConfigError, match="unquant does not match the draft model .* fp8"):
        checked_draft_quantization("unquant", dense[1], src)
    with pytest.raises(ConfigError, match="fp8: the draft model .* is not quantized"):
        checked_draft_quantization("fp8", dense[0], fp8)
    with pytest.raises(ConfigError, match="--speculative-draft-model-path /nonexistent/h does"):
        checked_draft_quantization(None, "/nonexistent/h", fp8)
    cpu = torch.device("cpu")
    heads = []
    for folder in (fp8, ref_dir):
        target, _, _ = load_model(folder, torch.float32, cpu)
        heads.append(load_nextn_head(target, folder, torch.float32, cpu))
    ours, ref = heads
    lin = [(a, b) for a, b in zip(ours.modules(), ref.modules())
           if isinstance(a, (ColumnLinear, RowLinear))]
    assert lin and all(a.fp8 is not None and b.fp8 is None for a, b in lin)
    for a, b in lin:
        torch.testing.assert_close(a.fp8.dequantized(), b.weight, rtol=0, atol=0)
    assert any(isinstance(getattr(m, "fp8", None), Fp8Experts) for m in ours.modules())


def test_gptq_picks_e4m3_values_closer_than_nearest():
    """bench/quant_accuracy.py's FP8 GPTQ checkpoint (quant_models.gptq with the e4m3 grid and
    the block scales of rounding to nearest): every value it picks is an e4m3 value, each within
    a few e4m3 steps of the nearest one, and over correlated inputs the layer's outputs land
    closer to the float layer's than rounding to nearest."""
    from pdcore.testing.quant_models import FP8_MAX, gptq

    g = torch.Generator().manual_seed(5)
    x = torch.randn(512, 256, generator=g) @ torch.randn(256, 256, generator=g)
    w = torch.randn(192, 256, generator=g)
    q8, scale = fp8_block_quantize(w, (128, 128))
    s = scale.repeat_interleave(128, 0)[:192].repeat_interleave(128, 1)
    grid = lambda v: v.float().clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()  # noqa: E731
    q = gptq(w, x.t() @ x / x.shape[0], s, grid).float()
    assert torch.equal(grid(q), q)
    err = lambda v: float((x @ (v * s - w).t()).pow(2).mean())  # noqa: E731
    assert err(q) < 0.8 * err(q8.float()), (err(q), err(q8.float()))
