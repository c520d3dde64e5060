"""#48: `--quantization` with SGLang's names, read from the checkpoint's own files, refused at
start-up (exit 2, naming the format and the ones pdserve runs) for a format pdserve does not
run; `--cuda-graph-bs` accepted with one warning line (no CUDA graphs here). Parse-level: no
model is loaded (the W8A8 model served end to end: tests/engine/test_w8a8.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pdcore.engine.model.quant_config import detect, gguf_file_type
from pdcore.engine.model.source import default_model_file
from pdcore.server.startup.args_parser import parse_server_args
from pdcore.testing.quant_models import w8a8_quantization_config


def _with_config(src, dst, **extra) -> str:
    """A copy of the tiny model's folder (links to its files) with config.json entries added."""
    os.makedirs(dst)
    for name in os.listdir(src):
        if name != "config.json":
            os.symlink(os.path.join(src, name), os.path.join(dst, name))
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(extra)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return str(dst)


def _exit2(argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        parse_server_args(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    return err


FP8_BLOCK = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
             "weight_block_size": [128, 128]}


def test_detected_from_the_checkpoint(tiny_llama_dir, tmp_path):
    assert gguf_file_type(default_model_file()) == "Q4_1"
    d = detect(os.path.dirname(default_model_file()), os.path.basename(default_model_file()))
    assert (d.name, d.detail) == ("gguf", "GGUF Q4_1")
    assert detect(str(tiny_llama_dir), None).name is None
    w8 = _with_config(tiny_llama_dir, tmp_path / "w8",
                      quantization_config=w8a8_quantization_config())
    assert detect(w8, None).name == "w8a8_int8"
    assert detect(_with_config(tiny_llama_dir, tmp_path / "f8", quantization_config=FP8_BLOCK),
                  None).detail == "fp8 weight blocks [128, 128]"
    ms = _with_config(tiny_llama_dir, tmp_path / "ms")
    with open(os.path.join(ms, "quant_model_description.json"), "w") as f:
        json.dump({"model.layers.0.mlp.down_proj.weight": "W8A8_DYNAMIC",
                   "model.norm.weight": "FLOAT"}, f)
    assert (detect(ms, None).name, detect(ms, None).detail) == (
        "modelslim", "msModelSlim W8A8_DYNAMIC")


def test_flag_and_checkpoint_agree_or_exit_2(tiny_llama_dir, tmp_path, capsys):
    base = ["--model-path"]
    assert parse_server_args([]).quantization == "gguf"  # the default model's GGUF
    assert parse_server_args(["--quantization", "gguf"]).quantization == "gguf"
    err = _exit2(["--quantization", "w8a8_int8"], capsys)
    assert "does not match" in err and "GGUF Q4_1" in err, err
    w8 = _with_config(tiny_llama_dir, tmp_path / "w8",
                      quantization_config=w8a8_quantization_config())
    for flag in ([], ["--quantization", "w8a8_int8"], ["--quantization", "compressed-tensors"]):
        assert parse_server_args([*base, w8, *flag]).quantization == "w8a8_int8"
    plain = str(tiny_llama_dir)
    assert parse_server_args([*base, plain]).quantization is None
    for flag in ("w8a8_int8", "fp8"):
        err = _exit2([*base, plain, "--quantization", flag], capsys)
        assert "is not quantized" in err, err
    f8 = _with_config(tiny_llama_dir, tmp_path / "f8", quantization_config=FP8_BLOCK)
    for flag in ([], ["--quantization", "fp8"]):
        assert parse_server_args([*base, f8, *flag]).quantization == "fp8"
    err = _exit2([*base, f8, "--quantization", "w8a8_int8"], capsys)
    assert "does not match" in err and "fp8 weight blocks [128, 128]" in err, err
    # a format pdserve does not run, by flag or found in the checkpoint: named with the ones
    # it runs
    for argv, named in (([*base, plain, "--quantization", "awq"], "--quantization awq"),
                        ([*base, _with_config(tiny_llama_dir, tmp_path / "awq",
                                              quantization_config={"quant_method": "awq"})],
                         "as awq")):
        err = _exit2(argv, capsys)
        assert named in err and "w8a8_int8" in err and "gguf" in err and "fp8" in err, err
    err = _exit2([*base, plain, "--quantization", "int3"], capsys)
    assert "invalid choice: 'int3'" in err, err


def test_cuda_graph_bs_accepted_with_one_warning(capsys):
    args = parse_server_args(["--cuda-graph-bs", "1", "2", "4", "8"])
    assert args.cuda_graph_bs == [1, 2, 4, 8]
    err = capsys.readouterr().err
    assert err.count("--cuda-graph-bs") == 1 and "has no effect here" in err, err


def test_through_the_cli(tiny_llama_dir, tmp_path):
    """The real program exits 2 before loading anything for a modelslim scheme it does not run
    (W8A16: int8 weights, float activations)."""
    ms = _with_config(tiny_llama_dir, tmp_path / "ms")
    with open(os.path.join(ms, "quant_model_description.json"), "w") as f:
        json.dump({"model.layers.0.mlp.down_proj.weight": "W8A16"}, f)
    r = subprocess.run([sys.executable, "-m", "pdcore", "serve", "--model-path", ms,
                        "--quantization", "modelslim", "--cuda-graph-bs", "1", "2"],
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 2, r.stderr
    assert "quantized as modelslim (msModelSlim W8A16" in r.stderr and "w8a8_int8" in r.stderr
