"""#48: msModelSlim folders (`--quantization modelslim`, the Ascend seed lines' format) on CPU.
msmodelslim does not run on CPU, so the folder is written to its documented layout at test time
from a compressed-tensors W8A8 checkpoint (pdcore/testing/quant_models.py): W8A8_DYNAMIC weights
(int8, per-channel weight_scale and zero weight_offset) load onto the W8A8 int8 path, and greedy
output equals transformers running the same quantized math; the schemes not built are refused
naming them."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdcore.config import ServerArgs
from pdcore.engine.model.layers import ColumnLinear, RowLinear
from pdcore.engine.model.loader import load_model
from pdcore.engine.model.quant_config import checked_quantization
from pdcore.errors import ConfigError
from pdcore.messages.io import SamplingParams
from pdcore.runtime.llm_engine import LLMEngine
from pdcore.testing.greedy import check_greedy, hf_greedy
from pdcore.testing.quant_models import (
    MODELSLIM_WEIGHTS, make_modelslim_w8a8_dynamic, make_w8a8_model, w8a8_reference)

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
    static = tmp_path / "static"
    static.mkdir()
    for name in os.listdir(ms):
        if name != "quant_model_description.json":
            os.symlink(os.path.join(ms, name), static / name)
    desc["model.layers.0.mlp.down_proj.weight"] = "W8A8"
    (static / "quant_model_description.json").write_text(json.dumps(desc))
    with pytest.raises(ConfigError, match="W8A8, W8A8_DYNAMIC.*runs W8A8_DYNAMIC only"):
        checked_quantization(None, str(static))


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


def test_greedy_equals_the_float_reference_of_the_same_math(folders, tiny_llama_dir):
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
