"""Where a DeepSeek-V3 checkpoint keeps its multi-token prediction (MTP) layer, which
`--speculative-algorithm NEXTN` drafts with (engine/model/nextn.py), read without torch: the
preflight checks it before the model loads (config.json and the weight files' headers only).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Container
from types import SimpleNamespace
from typing import Any

from pdcore.errors import ConfigError

NEXTN_ARCHS = ("DeepseekV3ForCausalLM",)
FLAG = "--speculative-algorithm NEXTN"


def mtp_layer_index(cfg: Any) -> int:
    """Where the MTP layer of a model with this config sits (num_hidden_layers); a ConfigError
    when the model is not a DeepSeek-V3 or has no MTP layer."""
    arch = (getattr(cfg, "architectures", None) or ["(none)"])[0]
    if arch not in NEXTN_ARCHS:
        raise ConfigError(f"{FLAG} drafts with a DeepSeek-V3 model's own MTP layer; the model "
                          f"is {arch}, not one of {list(NEXTN_ARCHS)} (use EAGLE with a draft "
                          "head, or NGRAM)")
    n = getattr(cfg, "num_nextn_predict_layers", None) or 0
    if n < 1:
        raise ConfigError(f"{FLAG}: the model has no MTP layer (config "
                          f"num_nextn_predict_layers is {n}); use EAGLE or NGRAM")
    return int(cfg.num_hidden_layers)


def mtp_prefix(names: Container[str], index: int, folder: str) -> str:
    """The MTP layer's weight prefix among `names`: model.layers.{index}. (the model's own
    checkpoint) or model.layers.0. (an exported NextN checkpoint)."""
    for p in (f"model.layers.{index}.", "model.layers.0."):
        if p + "eh_proj.weight" in names:
            return p
    raise ConfigError(f"{FLAG}: {folder} holds no MTP layer weights (model.layers.{index}."
                      "eh_proj.weight and the rest): the checkpoint was saved without its MTP "
                      "layer, though config.json's num_nextn_predict_layers says it has one")


def weight_names(folder: str) -> set[str]:
    """Every tensor name of the safetensors checkpoint in `folder` (index or headers)."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            return set(json.load(f)["weight_map"])
    names: set[str] = set()
    for n in sorted(os.listdir(folder)):
        if n.endswith(".safetensors"):
            with open(os.path.join(folder, n), "rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                names.update(json.loads(f.read(size)))
    return names


def check_nextn_folder(folder: str, draft: str | None = None) -> None:
    """The model at `folder` is a DeepSeek-V3 with an MTP layer whose weights are in `draft`
    (default: the same folder); a ConfigError saying what is missing otherwise."""
    try:
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
            cfg = SimpleNamespace(**json.load(f))
    except (OSError, ValueError, TypeError):
        return  # the model load says what is wrong with it
    index = mtp_layer_index(cfg)
    src = draft or folder
    try:
        names = weight_names(src)
    except (OSError, ValueError, KeyError, struct.error) as e:
        raise ConfigError(f"{FLAG}: cannot read the weight names of {src}: {e}") from None
    mtp_prefix(names, index, src)


# ---- MiMo (Xiaomi): a Qwen2 body whose checkpoint holds N MTP layers (engine/model/mimo.py) ----
MIMO_ARCHS = ("MiMoForCausalLM",)
MULTI_FLAG = "--enable-multi-layer-eagle"


def _arch(cfg: Any) -> str:
    return (getattr(cfg, "architectures", None) or ["(none)"])[0]


def is_mimo(cfg: Any) -> bool:
    return _arch(cfg) in MIMO_ARCHS


def mimo_mtp_layers(cfg: Any, multi: bool) -> int:
    """How many of a MiMo model's MTP layers draft: all of them with --enable-multi-layer-eagle
    (which needs >= 2), else the first. A ConfigError when the model is no MiMo or has too few."""
    n = int(getattr(cfg, "num_nextn_predict_layers", None) or 0)
    if not is_mimo(cfg):
        if multi:
            raise ConfigError(f"{MULTI_FLAG} drafts with the MTP layers of a MiMo model's own "
                              f"checkpoint (architectures {list(MIMO_ARCHS)}, config "
                              f"num_nextn_predict_layers >= 2); the model is {_arch(cfg)}")
        raise ConfigError(f"{FLAG}: the model is {_arch(cfg)}, not a MiMo")
    if n < (2 if multi else 1):
        raise ConfigError(f"{MULTI_FLAG if multi else FLAG}: the MiMo model has {n} MTP "
                          f"layer{'s' if n != 1 else ''} (config num_nextn_predict_layers); "
                          + ("multi-layer drafting needs >= 2 (drop the flag to draft with "
                             "the one layer)" if multi and n == 1 else "it needs at least one"))
    return n if multi else 1


def mimo_prefix(i: int) -> str:
    """Where MiMo's MTP layer i keeps its weights (model.mtp_layers.{i}.)."""
    return f"model.mtp_layers.{i}."


def check_mimo_names(names: Container[str], layers: int, folder: str, flag: str) -> None:
    for i in range(layers):
        if mimo_prefix(i) + "input_proj.weight" not in names:
            raise ConfigError(f"{flag}: {folder} holds no weights of MTP layer {i} "
                              f"({mimo_prefix(i)}input_proj.weight and the rest): the "
                              "checkpoint was saved without its MTP layers, though "
                              "config.json's num_nextn_predict_layers says it has them")


def check_mtp_folder(folder: str, draft: str | None = None, multi: bool = False,
                     algorithm: str = "NEXTN") -> None:
    """Preflight of a draft made of the model's own MTP layers: NEXTN (a DeepSeek-V3's layer or a
    MiMo's first) or --enable-multi-layer-eagle (a MiMo's N >= 2 layers, EAGLE or NEXTN); the
    weights in `draft` (default: the model's folder). A ConfigError saying what is missing."""
    try:
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
            cfg = SimpleNamespace(**json.load(f))
    except (OSError, ValueError, TypeError):
        return  # the model load says what is wrong with it
    if not multi:
        if algorithm != "NEXTN":
            return  # EAGLE: an EAGLE-1 head of its own folder
        if not is_mimo(cfg):
            check_nextn_folder(folder, draft)
            return
    layers = mimo_mtp_layers(cfg, multi)
    src = draft or folder
    try:
        names = weight_names(src)
    except (OSError, ValueError, KeyError, struct.error) as e:
        raise ConfigError(f"{MULTI_FLAG if multi else FLAG}: cannot read the weight names of "
                          f"{src}: {e}") from None
    check_mimo_names(names, layers, src, MULTI_FLAG if multi else FLAG)
