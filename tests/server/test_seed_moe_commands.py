"""Every DeepSeek / MoE `launch_server` line of the seed pages, with our program name and a tiny
model: what stops it, and that it parses once the hardware-only flags are swapped for CPU ones.

The lines (copied from /work/shared/seeds: 000 = the older PD page, 003 = the current one) are
multi-node GPU/NPU deployments. Each stops at exit 2 for one of three reasons, each named in the
message:
- a typo in the older page (`---disaggregation-transfer-backend`, three dashes);
- an NPU line (`--device npu`, the Ascend DeepSeek and MiMo decode lines): the NPU, named first,
  with what pdserve refuses listed after it (`--quantization modelslim`: the tiny float model is
  not quantized so; several tokenizer workers); `--cuda-graph-bs` is accepted (a warning: no
  CUDA graphs here) and the speculative flags (built) are never named among them;
- otherwise the one hardware-only flag: DeepEP (`--enable-deepep-moe` / `--moe-a2a-backend
  deepep`), which on CPU exits 2 saying to use `--moe-a2a-backend none`. The multi-node DP
  attention lines (`--nnodes 2 --tp-size 16 --dp-size 8 --enable-dp-attention`) stop only there:
  DP attention across nodes is built (pdcore.runtime.dp.nodes).
With DeepEP swapped for `none`, the NPU/RDMA flags for local ones and TP 16 / DP 8 for 2 / 2,
every line parses into a server configuration, the two-node ones as two nodes (their MoE/EP part
runs in tests/pd/test_pd_moe.py and tests/tp/test_moe_tp_ep.py, their two-node DP attention in
tests/server/test_dp_attention_nodes.py and test_seed_dp_commands.py).
"""

from __future__ import annotations

import importlib.util
import itertools
import shlex
import subprocess
import sys

import pytest
from pdserve_testing import parse_or_bf16_refusal
from seed_moe_lines import SEEDS
from seed_moe_lines import loopback_argv as _argv
from seed_moe_lines import strip_flags as _strip
from seed_moe_lines import swap_values as _swap

from pdcore.server.startup.args_parser import parse_server_args
from pdcore.testing.tiny_models import make_tiny_model

# flags swapped out to parse on CPU, with how many values each takes (-1: a list): the
# speculative ones (built, served in tests/pd/test_pd_spec_dp.py), --cuda-graph-bs (accepted)
# and those pdserve refuses (UNBUILT: named in the NPU lines' message)
UNBUILT = ("--quantization", "--tokenizer-worker-num")
LATER: dict[str, int] = {
    "--speculative-algorithm": 1, "--speculative-num-steps": 1, "--speculative-eagle-topk": 1,
    "--speculative-num-draft-tokens": 1, "--enable-multi-layer-eagle": 0,
    "--speculative-draft-model-quantization": 1, "--quantization": 1,
    "--cuda-graph-bs": -1, "--tokenizer-worker-num": 1,
}
TYPO = "---disaggregation-transfer-backend"
DEEPEP = ("--enable-deepep-moe", "--moe-a2a-backend deepep")


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("seed") / "m"), arch="qwen2_moe",
                           layers=1)


def _exit_message(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as e:
        parse_server_args(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    return err


@pytest.mark.parametrize("i", range(len(SEEDS)))
def test_seed_line_exits_2_naming_what_stops_it(i, tiny_moe, capsys):
    source, line = SEEDS[i]
    argv = _argv(line, tiny_moe)
    err = _exit_message(argv, capsys)
    if TYPO in argv:
        assert TYPO in err, err
        return
    later = [f for f in LATER if f in argv]
    if "npu" in argv and later:  # the NPU first, then every unbuilt flag of the line
        assert err.count("--device npu needs that hardware") == 1, err
        assert all(f in err for f in UNBUILT if f in argv), err
        assert "--speculative" not in err and "--cuda-graph-bs" not in err, err
        return
    assert not later, later
    # what remains stops only at DeepEP, naming the spelling the line used
    flag = DEEPEP[0] if DEEPEP[0] in argv else DEEPEP[1]
    assert flag in err and "--moe-a2a-backend none" in err, (source, err)


def test_lines_of_built_features_stop_only_at_hardware(tiny_moe, capsys):
    """A line with no flag of an unbuilt feature (the MiMo prefill line and the 12 multi-node
    DeepSeek lines without the older page's typo) stops at its hardware-only flags as it
    stands: DeepEP, then (MiMo) the NPU; with both set aside the DeepSeek lines parse as two
    nodes with DP attention."""
    plain = [(i, line) for i, (_, line) in enumerate(SEEDS)
             if TYPO not in line and not any(f in shlex.split(line) for f in LATER)]
    assert [i for i, _ in plain] == [0, 1, 2, 3, 8, 9, 10, 11, 12, 13, 14, 15, 16], plain
    for _, line in plain:
        argv = _argv(line, tiny_moe)
        err = _exit_message(argv, capsys)
        assert "deepep" in err and "--moe-a2a-backend none" in err, err
        argv = _strip(argv, {"--enable-deepep-moe": 0, "--deepep-mode": 1})
        if "deepep" in argv:
            argv[argv.index("deepep")] = "none"
        if "npu" in argv:
            err = _exit_message(argv, capsys)
            assert "npu" in err, err
            continue
        if "nixl" in argv and importlib.util.find_spec("pd_nixl") is None:
            argv[argv.index("nixl")] = "tcp"
        argv = _swap(_strip(argv, {"--disaggregation-ib-device": 1}), {"--tp-size": "2",
                                                                       "--dp-size": "2"})
        args = parse_server_args(argv)
        assert (args.nnodes, args.tp_size, args.dp_size, args.enable_dp_attention) == (
            2, 2, 2, True)


def _cpu_version(argv: list[str]) -> list[str]:
    """Hardware-only flags swapped for what this machine has; a two-node line stays two nodes
    (TP 16 / DP 8 -> 2 / 2)."""
    argv = _strip(argv, {**LATER, "--enable-deepep-moe": 0, "--disaggregation-ib-device": 1,
                         "--attention-backend": 1, "--device": 1, "--base-gpu-id": 1, TYPO: 1})
    out: list[str] = []
    for a in argv:
        if out and out[-1] == "--moe-a2a-backend":
            out.append("none")
        elif out and out[-1] in ("--tp-size", "--dp-size"):
            out.append("2")
        elif out and out[-1] == "--disaggregation-transfer-backend" and a == "ascend":
            out.append("tcp")
        else:
            out.append(a)
    return [*out, "--ep-size", "2"]


@pytest.mark.parametrize("i", range(len(SEEDS)))
def test_seed_line_parses_with_cpu_flags(i, tiny_moe):
    argv = _cpu_version(_argv(SEEDS[i][1], tiny_moe))
    if importlib.util.find_spec("pd_nixl") is None and "nixl" in argv:
        # the core's CI environment has no pd-nixl (its own matrix entry has); the line's other
        # flags still have to parse, so its backend becomes the built-in tcp
        argv[argv.index("nixl")] = "tcp"
    args = parse_or_bf16_refusal(argv)
    assert (args.tp_size, args.ep_size, args.moe_a2a_backend) == (2, 2, "none")
    assert args.disaggregation_mode in ("prefill", "decode")
    assert args.nnodes == (2 if i < 16 else 1)


def test_seed_line_through_the_cli(tiny_moe):
    """The real program: `pdserve serve` with the current page's DeepSeek decode line (two
    nodes, DP attention) exits 2 naming --moe-a2a-backend deepep."""
    argv = _argv(SEEDS[10][1], tiny_moe)
    r = subprocess.run([sys.executable, "-m", "pdcore", "serve", *argv], capture_output=True,
                       text=True, timeout=120, check=False)
    assert r.returncode == 2, r.stderr
    assert "--moe-a2a-backend deepep" in r.stderr and "--moe-a2a-backend none" in r.stderr


_SPEC = ("--speculative-algorithm", "--speculative-num-steps", "--speculative-eagle-topk",
         "--speculative-num-draft-tokens")


def test_the_ascend_deepseek_lines_nextn_flags(tmp_path, capsys):
    """The Ascend DeepSeek lines' NEXTN settings (steps 1 / 2 draft tokens on prefill, 3 / 4 on
    decode) parse for a DeepSeek-V3 with its MTP layer, unified and in the lines' own PD mode
    (the MTP layer's latent K/V travel as one more MLA layer: tests/pd/test_pd_nextn.py), with
    and without the lines' DP attention (served in tests/engine/test_speculative_dp.py and
    tests/pd/test_pd_spec_dp.py)."""
    from pdcore.testing.tiny_models import add_mtp_layer

    model = add_mtp_layer(make_tiny_model(str(tmp_path / "ds"), arch="deepseek_v3", layers=2))
    nextn = [line for _, line in SEEDS if "NEXTN" in line]
    assert len(nextn) == 2
    for line in nextn:
        argv = shlex.split(line)
        flags = [a for i, a in enumerate(argv) if a in _SPEC or (i and argv[i - 1] in _SPEC)]
        steps = int(flags[flags.index("--speculative-num-steps") + 1])
        mode = argv[argv.index("--disaggregation-mode") + 1]
        assert "--enable-dp-attention" in argv and "--tp-size" in argv
        for extra, dpa in itertools.product(
                ([], ["--disaggregation-mode", mode, "--disaggregation-transfer-backend", "tcp"]),
                ([], ["--tp-size", "2", "--dp-size", "2", "--enable-dp-attention"])):
            args = parse_server_args(["--model-path", model, *flags, *extra, *dpa])
            assert (args.speculative_algorithm, args.speculative_num_steps,
                    args.speculative_eagle_topk, args.speculative_num_draft_tokens) == (
                "NEXTN", steps, 1, steps + 1)
            assert args.disaggregation_mode == (mode if extra else "null")
            assert args.enable_dp_attention == bool(dpa)


def test_the_ascend_mimo_modelslim_line_serves(tmp_path):
    """#48: the seed's Ascend MiMo decode line (`--quantization modelslim
    --speculative-draft-model-quantization unquant`, EAGLE over the model's own MTP layers,
    `--cuda-graph-bs`) with its NPU/PD-only flags set aside (device, attention backend, GPU id,
    TP 8 -> 1, --trust-remote-code, DeepEP,
    the disaggregation ones: served unified) and the model swapped for a tiny MiMo in
    msModelSlim's W8A8_DYNAMIC layout, MTP layers included, serves: its greedy output equals the
    same checkpoint's without drafts (speculative decoding changes no greedy token)."""
    from pdcore.config import ServerArgs
    from pdcore.messages.io import SamplingParams
    from pdcore.runtime.llm_engine import LLMEngine
    from pdcore.testing.quant_models import make_modelslim_w8a8_dynamic, make_w8a8_model
    from pdcore.testing.tiny_models import make_tiny_mimo

    line = next(s for _, s in SEEDS if "MiMo" in s and "modelslim" in s)
    mimo = make_tiny_mimo(str(tmp_path / "float"))
    ms = make_modelslim_w8a8_dynamic(make_w8a8_model(mimo, str(tmp_path / "w8a8")),
                                     str(tmp_path / "ms"))
    argv = _strip(_argv(line, ms), {"--attention-backend": 1, "--device": 1, "--base-gpu-id": 1,
                                    "--moe-a2a-backend": 1, "--deepep-mode": 1,
                                    "--disaggregation-mode": 1,
                                    "--disaggregation-transfer-backend": 1,
                                    "--disaggregation-bootstrap-port": 1,
                                    "--trust-remote-code": 0})
    # 8 NPUs -> one CPU rank; a small pool; the tiny stand-in ships no remote code (pdserve
    # reads MiMo's config.json itself)
    argv = [*_swap(argv, {"--tp-size": "1"}), "--max-total-tokens", "1024"]
    args = parse_server_args(argv)
    assert (args.quantization, args.speculative_draft_model_quantization,
            args.speculative_algorithm, args.enable_multi_layer_eagle) == (
        "modelslim", "modelslim", "EAGLE", True)
    prompt = [1, 17, 42, 99, 7, 300, 5, 11]
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    outs = []
    for a in (args, ServerArgs(model_path=ms, max_total_tokens=1024)):
        eng = LLMEngine(a)
        try:
            outs.append(eng.generate([prompt], params)[0]["output_ids"])
        finally:
            eng.close()
    assert len(outs[0]) == 12 and outs[0] == outs[1], outs
