"""The torch-free part of `--enable-dp-attention` (pdcore.engine.parallel.dp_attention): the flag checks
run at parse time and the process layout the HTTP process's DP controller sets up, so neither
the CLI nor the HTTP process imports torch for it."""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import uuid
from pathlib import Path

from pdcore.config import ServerArgs
from pdcore.errors import ConfigError

# the families whose MoE layer is DP-aware (pdcore.engine.model.moe.MoE)
MOE_ARCHS = frozenset({"Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM",
                       "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"})


def active(args: ServerArgs) -> bool:
    """DP attention changes anything only with more than one DP rank."""
    return bool(args.enable_dp_attention) and args.dp_size > 1


def check_args(args: ServerArgs) -> None:
    """Flag checks (exit 2 at parse time): divisibility, the lm-head flag, a dense model."""
    if args.enable_dp_lm_head and not args.enable_dp_attention:
        raise ConfigError("--enable-dp-lm-head needs --enable-dp-attention (it shards the lm "
                          "head inside each DP attention group)")
    if not args.enable_dp_attention:
        return
    if args.tp_size % args.dp_size:
        raise ConfigError(f"--enable-dp-attention: --tp-size {args.tp_size} must be a multiple "
                          f"of --dp-size {args.dp_size} (each DP rank gets tp/dp attention ranks)")
    arch = _architecture(args.model_path)
    if arch is not None and arch not in MOE_ARCHS:
        raise ConfigError(
            f"--enable-dp-attention is for MoE models (attention per DP rank, experts over all "
            f"ranks); {arch} is dense: drop the flag, --dp-size {args.dp_size} alone runs "
            "independent replicas")


def _architecture(model_path: str | None) -> str | None:
    """The config.json architecture of a local HF folder (None when unknown here: a GGUF file
    or the default model; build_engine then checks the loaded model)."""
    if not model_path:
        return None
    cfg = Path(os.path.expanduser(model_path)) / "config.json"
    try:
        archs = json.loads(cfg.read_text()).get("architectures") or []
    except (OSError, ValueError):
        return None
    return archs[0] if archs else None


# ---- process layout ----------------------------------------------------------------------------
def attention_size(args: ServerArgs) -> int:
    return args.tp_size // args.dp_size


def replica_ranks(args: ServerArgs) -> range:
    """The global ranks of this replica's DP rank (its first one leads the replica)."""
    a = attention_size(args)
    return range(args.dp_attention_rank * a, (args.dp_attention_rank + 1) * a)


def new_init_method() -> str:
    """Where the ranks of one host meet: a file store under a fresh, unguessable name. Not a
    loopback port: a port picked free here and bound later by rank 0 can be taken in between by
    any other process of the host (EADDRINUSE at start-up, seen in CI). The store removes its
    file when its last rank leaves the group."""
    return "file://" + os.path.join(tempfile.gettempdir(), f"pdserve-rdzv-{uuid.uuid4().hex}")


def replica_args(args: ServerArgs, dp_rank: int, init_method: str,
                 base_gpu_id: int) -> ServerArgs:
    """DP rank `dp_rank`'s server arguments (from the replica's own): its accelerators start at
    its first global rank, counted from the server's `base_gpu_id`."""
    return dataclasses.replace(args, dp_attention_rank=dp_rank, dp_attention_init=init_method,
                               base_gpu_id=base_gpu_id + dp_rank * attention_size(args))
