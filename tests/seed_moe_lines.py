"""The DeepSeek / MoE `launch_server` lines of the seed pages (copied from /work/shared/seeds:
000 = the older PD page, 003 = the current one), shared by tests/server/test_seed_moe_commands.py
(what stops each line, and that it parses with CPU flags) and tests/pd/test_pd_spec_dp.py (the
Ascend DeepSeek NEXTN lines served as P and D)."""

from __future__ import annotations

import shlex

_DS = "--model-path deepseek-ai/DeepSeek-V3-0324"
_P0 = ("--host ${local_ip} --port 30000 --trust-remote-code --dist-init-addr "
       "${prefill_master_ip}:5000 --nnodes 2 --node-rank 0 --tp-size 16 --dp-size 8 "
       "--enable-dp-attention")
_D0 = ("--host ${local_ip} --port 30001 --trust-remote-code --dist-init-addr "
       "${decode_master_ip}:5000 --nnodes 2 --node-rank 0 --tp-size 16 --dp-size 8 "
       "--enable-dp-attention")


def _both_nodes(line: str) -> list[str]:
    return [line, line.replace("--node-rank 0", "--node-rank 1")]


_OLD_TAIL_P = "--enable-deepep-moe --deepep-mode normal --mem-fraction-static 0.8"
_OLD_TAIL_D = ("--enable-deepep-moe --deepep-mode low_latency --mem-fraction-static 0.8 "
               "--max-running-requests 128")
_NEW_TAIL_P = "--moe-a2a-backend deepep --mem-fraction-static 0.8"
_NEW_TAIL_D = "--moe-a2a-backend deepep --mem-fraction-static 0.8 --max-running-requests 128"
_IB = "--disaggregation-ib-device ${device_name}"
_MIMO = ("--model-path /path/to/MiMo-V2-Flash-w8a8-all-0512 --attention-backend ascend "
         "--device npu --tp-size 8 --nnodes 1 --node-rank 0")
_ASCEND_DS = ("--model-path ${MODEL_PATH} --trust-remote-code --nnodes 1 --node-rank 0 "
              "--tp-size 16")

SEEDS: list[tuple[str, str]] = [
    *[("000", s) for s in _both_nodes(f"{_DS} {_IB} --disaggregation-mode prefill {_P0} "
                                      f"{_OLD_TAIL_P}")],
    *[("000", s) for s in _both_nodes(f"{_DS} {_IB} --disaggregation-mode decode {_D0} "
                                      f"{_OLD_TAIL_D}")],
    *[("000", s) for s in _both_nodes(f"{_DS} ---disaggregation-transfer-backend nixl "
                                      f"--disaggregation-mode prefill {_P0} {_OLD_TAIL_P}")],
    *[("000", s) for s in _both_nodes(f"{_DS} ---disaggregation-transfer-backend nixl "
                                      f"--disaggregation-mode decode {_D0} {_OLD_TAIL_D}")],
    *[("003", s) for s in _both_nodes(f"{_DS} {_IB} --disaggregation-mode prefill {_P0} "
                                      f"{_NEW_TAIL_P}")],
    *[("003", s) for s in _both_nodes(f"{_DS} {_IB} --disaggregation-mode decode {_D0} "
                                      f"{_NEW_TAIL_D}")],
    *[("003", s) for s in _both_nodes(f"{_DS} --disaggregation-transfer-backend nixl "
                                      f"--disaggregation-mode prefill {_P0} {_NEW_TAIL_P}")],
    *[("003", s) for s in _both_nodes(f"{_DS} --disaggregation-transfer-backend nixl "
                                      f"--disaggregation-mode decode {_D0} {_NEW_TAIL_D}")],
    ("003", (f"{_MIMO} --chunked-prefill-size -1 --trust-remote-code --port 10000 --host "
            "127.0.0.1 --max-running-requests 16 --mem-fraction-static 0.8 "
            "--disaggregation-mode prefill --disaggregation-transfer-backend ascend "
            "--disaggregation-bootstrap-port 8996 --base-gpu-id 0 --disable-radix-cache "
            "--disable-cuda-graph --moe-a2a-backend deepep --deepep-mode normal")),
    ("003", (f"{_MIMO} --trust-remote-code --port 10001 --host 127.0.0.1 "
            "--max-running-requests 16 --mem-fraction-static 0.8 --disaggregation-mode decode "
            "--disaggregation-transfer-backend ascend --disaggregation-bootstrap-port 8996 "
            "--base-gpu-id 8 --disable-radix-cache --cuda-graph-bs 1 2 4 8 10 12 14 16 "
            "--quantization modelslim --speculative-draft-model-quantization unquant "
            "--speculative-algorithm EAGLE --speculative-num-steps 3 --speculative-eagle-topk 1 "
            "--speculative-num-draft-tokens 4 --enable-multi-layer-eagle "
            "--moe-a2a-backend deepep --deepep-mode low_latency")),
    ("003", ("--model-path ${MODEL_PATH} --disaggregation-mode prefill --host ${P_IP[$i]} "
            "--port 8000 --disaggregation-bootstrap-port $((8998+$i)) --trust-remote-code "
            "--nnodes 1 --node-rank 0 --tp-size 16 --mem-fraction-static 0.7 "
            "--attention-backend ascend --device npu --quantization modelslim "
            "--disaggregation-transfer-backend ascend --max-running-requests 32 "
            "--context-length 8192 --disable-radix-cache --chunked-prefill-size -1 "
            "--max-prefill-tokens 10240 --moe-a2a-backend deepep --deepep-mode normal "
            "--speculative-algorithm NEXTN --speculative-num-steps 1 --speculative-eagle-topk 1 "
            "--speculative-num-draft-tokens 2 --dp-size 8 --enable-dp-attention "
            "--disable-shared-experts-fusion --dtype bfloat16")),
    ("003", ("--model-path ${MODEL_PATH} --disaggregation-mode decode --host ${D_IP[$i]} "
            "--port 8001 --trust-remote-code --nnodes 1 --node-rank 0 --tp-size 16 "
            "--dp-size 16 --mem-fraction-static 0.8 --max-running-requests 448 "
            "--attention-backend ascend --device npu --quantization modelslim "
            "--moe-a2a-backend deepep --enable-dp-attention --deepep-mode low_latency "
            "--enable-dp-lm-head --cuda-graph-bs 2 4 6 8 10 12 14 16 18 20 22 24 26 28 "
            "--disaggregation-transfer-backend ascend --watchdog-timeout 9000 "
            "--context-length 8192 --speculative-algorithm NEXTN --speculative-num-steps 3 "
            "--speculative-eagle-topk 1 --speculative-num-draft-tokens 4 "
            "--prefill-round-robin-balance --disable-shared-experts-fusion --dtype bfloat16 "
            "--tokenizer-worker-num 4 --load-balance-method round_robin")),
]
assert len(SEEDS) == 20


def loopback_argv(line: str, model: str) -> list[str]:
    """The seed line for this machine: loopback for every address, the tiny model, shell
    expressions evaluated as the page's loops would for the first node."""
    for var in ("${local_ip}", "${prefill_master_ip}", "${decode_master_ip}", "${P_IP[$i]}",
                "${D_IP[$i]}"):
        line = line.replace(var, "127.0.0.1")
    line = line.replace("${device_name}", "mlx5_0").replace("$((8998+$i))", "8998")
    argv = shlex.split(line)
    i = argv.index("--model-path")
    argv[i + 1] = model
    return argv


def swap_values(argv: list[str], values: dict[str, str]) -> list[str]:
    """argv with the value after each flag named in `values` replaced by it."""
    return [values.get(argv[k - 1], a) if k else a for k, a in enumerate(argv)]


def strip_flags(argv: list[str], flags: dict[str, int]) -> list[str]:
    """argv without the flags named, each with its number of values (-1: all up to the next
    flag)."""
    out, i = [], 0
    while i < len(argv):
        n = flags.get(argv[i])
        if n is None:
            out.append(argv[i])
            i += 1
            continue
        i += 1
        if n < 0:
            while i < len(argv) and not argv[i].startswith("--"):
                i += 1
        else:
            i += n
    return out
