"""#48: msModelSlim folders (`--quantization modelslim`, the Ascend seed lines' format) on CPU.
msmodelslim does not run on CPU, so the folder is written to its documented layout at test time
(pdcore/testing/quant_models.py): W8A8_DYNAMIC weights (int8, per-channel weight_scale and zero
weight_offset) load onto the W8A8 int8 path -- a dense Llama's, and a DeepSeek-V3's MLA
projections, dense MLP, routed and shared experts -- as do W4A8_DYNAMIC MoE experts (4-bit values
packed two rows a byte, per channel); greedy output equals transformers running the same
quantized math; the seed's Ascend DeepSeek lines serve the W4A8 one; the schemes not built are
refused naming them."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdcore.config import ServerArgs
from pdcore.engine.model.layers import ColumnLinear, RowLinear
from pdcore.engine.model.modelslim import StaticInt8Weight, unpack_int4_rows
from pdcore.engine.model.moe import MoE
from pdcore.engine.model.loader import load_model
from pdcore.engine.model.quant_config import checked_quantization
from pdcore.errors import ConfigError
from pdcore.messages.io import SamplingParams
from pdcore.runtime.llm_engine import LLMEngine
from pdcore.testing.greedy import check_greedy, hf_greedy
from pdcore.server.startup.args_parser import parse_server_args
from pdcore.testing.modelslim_models import (
    deepseek_int8_reference, make_modelslim_deepseek, modelslim_dequantized_folder,
    static_input_ranges)
from pdcore.testing.quant_models import (
    MODELSLIM_WEIGHTS, make_modelslim_w8a8_dynamic, make_w8a8_model, w8a8_reference)
from pdcore.testing.tiny_models import add_mtp_layer, make_tiny_model

PROMPTS = [[1, 17, 42, 99, 7, 300, 5], list(range(30, 70))]
NEW = 12


@pytest.fixture(scope="module")
def folders(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("modelslim")
    w8a8 = make_w8a8_model(str(tiny_llama_dir), str(root / "w8a8"))
    return w8a8, make_modelslim_w8a8_dynamic(w8a8, str(root / "ms"))


def test_detected_and_checked(folders, tmp_path):
    _, ms = folders
    assert checked_quantization(None, ms) == "modelslim"
    assert checked_quantization("modelslim", ms) == "modelslim"
    with pytest.raises(ConfigError, match="w8a8_int8 does not match"):
        checked_quantization("w8a8_int8", ms)
    with open(os.path.join(ms, "quant_model_description.json"), encoding="utf-8") as f:
        desc = json.load(f)
    other = tmp_path / "w8a16"
    other.mkdir()
    for name in os.listdir(ms):
        if name != "quant_model_description.json":
            os.symlink(os.path.join(ms, name), other / name)
    desc["model.layers.0.mlp.down_proj.weight"] = "W8A16"
    (other / "quant_model_description.json").write_text(json.dumps(desc))
    with pytest.raises(ConfigError, match="W8A16, W8A8_DYNAMIC.*runs W4A8_DYNAMIC, W8A8, "
                                          "W8A8_DYNAMIC only"):
        checked_quantization(None, str(other))


def test_nonzero_offsets_refused(folders, tmp_path):
    _, ms = folders
    bad = tmp_path / "bad"
    bad.mkdir()
    for name in os.listdir(ms):
        if name != MODELSLIM_WEIGHTS:
            os.symlink(os.path.join(ms, name), bad / name)
    sd = load_file(os.path.join(ms, MODELSLIM_WEIGHTS))
    sd["model.layers.1.mlp.up_proj.weight_offset"][3] = 2.0
    save_file(sd, str(bad / MODELSLIM_WEIGHTS))
    with pytest.raises(ConfigError, match="up_proj.weight_offset is not zero"):
        load_model(str(bad), torch.float32, torch.device("cpu"))


def test_greedy_equals_the_float_reference_of_the_same_math(folders, tiny_llama_dir,
                                                           monkeypatch):
    monkeypatch.setenv("PDCORE_W8A8_LM_HEAD", "float")  # the reference's lm_head: float32
    w8a8, ms = folders
    model, cfg, _ = load_model(ms, torch.float32, torch.device("cpu"))
    linears = [m for m in model.modules() if isinstance(m, (ColumnLinear, RowLinear))]
    assert len(linears) == 4 * cfg.num_hidden_layers and all(m.int8 is not None for m in linears)
    del model
    ref = w8a8_reference(w8a8, str(tiny_llama_dir))  # the same int8 values and scales
    eng = LLMEngine(ServerArgs(model_path=ms, max_total_tokens=1024, page_size=4))
    try:
        outs = eng.generate(PROMPTS, SamplingParams(max_new_tokens=NEW, temperature=0.0,
                                                    ignore_eos=True), return_logprob=True)
    finally:
        eng.close()
    verdicts = [check_greedy(o["output_ids"], hf_greedy(ref, p, NEW),
                             [lp for lp, *_ in o["output_logprobs"]], logprob_tol=8e-4)
                for p, o in zip(PROMPTS, outs)]
    assert verdicts.count("identical") >= 1, verdicts


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    """A tiny DeepSeek-V3 (one dense layer, two MoE layers, an MTP layer) in msModelSlim's
    W8A8_DYNAMIC layout and with its routed experts W4A8_DYNAMIC."""
    root = tmp_path_factory.mktemp("modelslim_ds3")
    src = add_mtp_layer(make_tiny_model(str(root / "float"), arch="deepseek_v3", layers=3,
                                        seed=5))
    out = {s: make_modelslim_deepseek(src, str(root / s), w4a8=s == "w4a8")
           for s in ("w8a8", "w4a8")}
    # static W8A8 for every linear layer transformers runs (MLA, dense MLP, shared experts),
    # calibrated on two random prompts; the routed experts and the MTP layer W8A8_DYNAMIC
    g = torch.Generator().manual_seed(1)
    out["static_ranges"] = static_input_ranges(
        src, [torch.randint(3, 500, (n,), generator=g).tolist() for n in (40, 60)])
    out["static"] = make_modelslim_deepseek(src, str(root / "static"),
                                            static=out["static_ranges"])
    return out


def _linked_copy(src: str, dst, skip: str):  # type: ignore[no-untyped-def]
    dst.mkdir()
    for name in os.listdir(src):
        if name != skip:
            os.symlink(os.path.join(src, name), dst / name)
    return dst


def test_deepseek_schemes_checked(deepseek, tmp_path):
    """W4A8 per channel runs; per group (scales per K-group), a scheme not built (W8A16), W4A8
    outside the experts and static W8A8 experts are refused naming them."""
    ms = deepseek["w4a8"]
    assert checked_quantization(None, ms) == "modelslim"
    with open(os.path.join(ms, "quant_model_description.json"), encoding="utf-8") as f:
        desc = json.load(f)
    cases = [({"group_size": 256}, "group_size 256.*per-group W4A8 scales are not run"),
             ({"model.layers.1.mlp.experts.0.up_proj.weight": "W8A16"},
              "W4A8_DYNAMIC, W8A16.*pdserve runs W4A8_DYNAMIC, W8A8, W8A8_DYNAMIC only")]
    for i, (change, match) in enumerate(cases):
        bad = _linked_copy(ms, tmp_path / str(i), "quant_model_description.json")
        (bad / "quant_model_description.json").write_text(json.dumps({**desc, **change}))
        with pytest.raises(ConfigError, match=match):
            checked_quantization("modelslim", str(bad))
    bad = _linked_copy(ms, tmp_path / "attn", "quant_model_description.json")
    (bad / "quant_model_description.json").write_text(json.dumps(
        {**desc, "model.layers.0.self_attn.o_proj.weight": "W4A8_DYNAMIC"}))
    with pytest.raises(ConfigError, match="o_proj.weight is W4A8_DYNAMIC; pdserve runs "
                                          "msModelSlim's W4A8 for MoE experts only"):
        load_model(str(bad), torch.float32, torch.device("cpu"))
    bad = _linked_copy(ms, tmp_path / "experts", "quant_model_description.json")
    (bad / "quant_model_description.json").write_text(json.dumps(
        {**desc, "model.layers.1.mlp.experts.3.down_proj.weight": "W8A8"}))
    with pytest.raises(ConfigError, match="experts.3.down_proj.weight is static W8A8; MoE "
                                          "experts run W8A8_DYNAMIC or W4A8_DYNAMIC"):
        load_model(str(bad), torch.float32, torch.device("cpu"))


def test_static_w8a8_math():
    """A static W8A8 layer of two fused parts computes msModelSlim's documented formula:
    x_q = clamp(round(x / input_scale + input_offset), -128, 127) per part,
    y = (x_q . w_q + quant_bias) * deq_scale, exactly (inputs past the range clamp to -128 and
    127, which the native GEMM takes as -127 and a correction)."""
    g = torch.Generator().manual_seed(0)
    parts, want = [], []
    x = torch.randn(9, 40, generator=g) * 3
    for n, s, off in ((24, 0.02, -5.0), (8, 0.05, 7.0)):
        q = torch.randint(-128, 128, (n, 40), generator=g, dtype=torch.int8)
        deq = torch.rand(n, generator=g) * 1e-3
        qbias = torch.randint(-5000, 5000, (n,), generator=g, dtype=torch.int32)
        parts.append((q, s, off, deq, qbias))
        xq = torch.round(x / s + off).clamp(-128, 127)
        assert bool((xq == -128).any()) and bool((xq == 127).any())
        acc = (xq.long() @ q.long().t()).to(torch.int32)
        want.append((acc + qbias).float() * deq)
    torch.testing.assert_close(StaticInt8Weight(parts)(x), torch.cat(want, -1), rtol=0, atol=0)


def test_deepseek_weights_stay_int8(deepseek):
    """Every MLA projection but kv_b (absorbed: de-quantized at load), the dense MLP, the shared
    experts and each routed expert hold int8 weights; the W4A8 experts' values are the
    checkpoint's 4-bit ones, unpacked."""
    ms = deepseek["w4a8"]
    model, cfg, _ = load_model(ms, torch.float32, torch.device("cpu"))
    linears = [m for m in model.modules() if isinstance(m, (ColumnLinear, RowLinear))]
    # q_a, q_b, kv_a, o per layer; the dense MLP's gate_up and down; the shared experts' gate_up
    assert len(linears) == 4 * cfg.num_hidden_layers + 2 + 2
    assert all(m.int8 is not None for m in linears)
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    assert len(moes) == 2 and all(m.int8 is not None and m.shared.down_int8 is not None
                                  for m in moes)
    sd = load_file(os.path.join(ms, "quant_model_weight_w4a8_dynamic.safetensors"))
    p = "model.layers.2.mlp.experts.5."
    gate, up = (unpack_int4_rows(sd[p + n + ".weight"]) for n in ("gate_proj", "up_proj"))
    w13 = moes[1].int8.w13[5]
    assert torch.equal(w13.matrix(), torch.cat([gate, up]))
    assert int(w13.matrix().abs().max()) <= 8
    torch.testing.assert_close(w13.scale, torch.cat([sd[p + "gate_proj.weight_scale"],
                                                     sd[p + "up_proj.weight_scale"]]).reshape(-1))


def _generate(path: str, prompts: list[list[int]], args: ServerArgs | None = None
              ) -> list[dict]:
    eng = LLMEngine(args or ServerArgs(model_path=path, max_total_tokens=1024, page_size=4,
                                       chunked_prefill_size=64))
    try:
        return eng.generate(prompts, SamplingParams(max_new_tokens=NEW, temperature=0.0,
                                                    ignore_eos=True), return_logprob=True)
    finally:
        eng.close()


@pytest.mark.parametrize("scheme", ["w8a8", "w4a8", "static"])
def test_deepseek_greedy_equals_the_float_reference(scheme, deepseek, tmp_path, monkeypatch):
    """Greedy tokens equal transformers' on the de-quantized weights with every int8 GEMM's
    input fake-quantized per token, or with its static scale and offset (the same math in
    float); logprobs within 8e-4 on at least one of the two prompts (the other may cross a
    rounding or routing near-tie). The lm_head stays float32, as the reference's
    (PDCORE_W8A8_LM_HEAD=float; the default rounds it to bf16)."""
    monkeypatch.setenv("PDCORE_W8A8_LM_HEAD", "float")
    ms = deepseek[scheme]
    ref = deepseek_int8_reference(modelslim_dequantized_folder(ms, str(tmp_path / "ref")),
                                  deepseek["static_ranges"] if scheme == "static" else None)
    outs = _generate(ms, PROMPTS)
    tokens = [check_greedy(o["output_ids"], hf_greedy(ref, p, NEW)) for p, o in zip(PROMPTS, outs)]
    assert all(v == "identical" or v.startswith("near-tie") for v in tokens), tokens
    close = []
    for p, o in zip(PROMPTS, outs):
        try:
            close.append(check_greedy(o["output_ids"], hf_greedy(ref, p, NEW),
                                      [lp for lp, *_ in o["output_logprobs"]], logprob_tol=8e-4))
        except AssertionError as e:
            close.append(str(e))
    assert close.count("identical") >= 1, close


def test_the_ascend_deepseek_lines_serve(deepseek):
    """#48: the seed's Ascend DeepSeek-R1 W4A8 prefill and decode lines (`--quantization
    modelslim`, NEXTN over the model's own MTP layer, --dtype bfloat16) with their NPU / PD /
    multi-rank flags set aside (device, attention backend, DeepEP, disaggregation, nodes,
    TP 16 / DP 16 -> one CPU rank, DP attention and its lm_head, the NPU graph sizes, tokenizer
    workers, balance methods, the watchdog, --trust-remote-code: served unified) and the model
    swapped for the tiny W4A8 DeepSeek serve a request, both the same greedy tokens."""
    from seed_moe_lines import SEEDS
    from seed_moe_lines import loopback_argv, strip_flags, swap_values

    lines = [s for _, s in SEEDS if "NEXTN" in s and "modelslim" in s]
    assert len(lines) == 2
    prompt = [1, 17, 42, 99, 7, 300, 5, 11]
    outs = []
    for line in lines:
        argv = strip_flags(loopback_argv(line, deepseek["w4a8"]), {
            "--attention-backend": 1, "--device": 1, "--moe-a2a-backend": 1, "--deepep-mode": 1,
            "--disaggregation-mode": 1, "--disaggregation-transfer-backend": 1,
            "--disaggregation-bootstrap-port": 1, "--trust-remote-code": 0, "--nnodes": 1,
            "--node-rank": 1, "--dp-size": 1, "--enable-dp-attention": 0,
            "--enable-dp-lm-head": 0, "--tokenizer-worker-num": 1, "--load-balance-method": 1,
            "--prefill-round-robin-balance": 0, "--watchdog-timeout": 1,
            "--disable-shared-experts-fusion": 0, "--cuda-graph-bs": -1})
        # one CPU rank, the tiny model's context, a small pool
        argv = [*swap_values(argv, {"--tp-size": "1", "--context-length": "1024",
                                    "--max-running-requests": "4"}),
                "--max-total-tokens", "1024"]
        args = parse_server_args(argv)
        assert (args.quantization, args.speculative_algorithm, args.dtype) == (
            "modelslim", "NEXTN", "bfloat16")
        outs.append(_generate("", [prompt], args)[0]["output_ids"])
    assert len(outs[0]) == NEW and outs[0] == outs[1], outs
