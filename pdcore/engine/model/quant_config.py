"""Which quantization a checkpoint carries, read from its own files as SGLang reads them, and the
`--quantization` check at start-up (pure Python: no torch, no weights read).

- an HF folder: `quantization_config` (or `compression_config`) in config.json. compressed-tensors
  with int8 weights per output channel and int8 activations per token at run time (symmetric)
  is `w8a8_int8`; 8-bit float weights are `fp8`; any other scheme keeps the method's name;
- an Ascend msModelSlim folder: its own description file, quant_model_description.json
  (`modelslim`; its entries name each tensor's scheme: W8A8, W8A8_DYNAMIC, W4A8_DYNAMIC, ...);
- a GGUF file: `gguf`, with the file type of its header (Q4_1, Q8_0, ...).

What pdserve runs (RUNS): `w8a8_int8` (int8 x int8 GEMMs, engine/model/quant.py; also
msModelSlim's W8A8_DYNAMIC as `modelslim`), `fp8`
(FP8 weights kept 8-bit, engine/model/fp8.py) and `gguf` (de-quantized at load,
engine/model/gguf_cache.py, or kept packed, gguf_packed.py). Any other format, named by the flag
or found in the checkpoint, is refused at start-up naming it and the formats pdserve runs: loading it as
if it were float would serve garbage.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass

from pdcore.config import QUANT_CHOICES
from pdcore.errors import ConfigError

RUNS = {
    "w8a8_int8": "int8 weights per output channel and int8 activations per token (compressed-"
                 "tensors W8A8 checkpoints): int8 x int8 -> int32 GEMMs",
    "gguf": "GGUF files, de-quantized to --dtype at load (PDCORE_GGUF_PACKED=1: Q8_0, Q4_0, "
            "Q4_1, Q4_K and Q6_K kept packed)",
    "modelslim": "msModelSlim W8A8_DYNAMIC folders (int8 weights per output channel, zero "
                 "offsets; activations per token at run time; MLA and MoE included), static "
                 "W8A8 linear layers (per-tensor input scale and offset, deq_scale, "
                 "quant_bias) and W4A8_DYNAMIC MoE experts per channel: int8 GEMMs",
    "fp8": "float8 e4m3 weights with per-tensor, per-channel or block scales (DeepSeek-V3's "
           "128x128 weight_scale_inv), kept FP8 and de-quantized per layer at compute",
}
# flag values that name a format the checkpoint's detected one satisfies
ALIASES = {"compressed-tensors": "w8a8_int8", "w8a8_int8": "w8a8_int8", "gguf": "gguf",
           "fp8": "fp8", "modelslim": "modelslim"}
# msModelSlim schemes pdserve runs (FLOAT tensors aside; engine/model/modelslim.py)
MODELSLIM_RUNS = {"W8A8_DYNAMIC", "W4A8_DYNAMIC", "W8A8"}
MODELSLIM_FILE = "quant_model_description.json"


@dataclass(frozen=True)
class Detected:
    name: str | None  # an SGLang --quantization name; None: not quantized
    detail: str = ""  # what was read: the scheme, the GGUF file type
    source: str = ""  # the file it was read from


def _int8_w8a8(groups: dict) -> bool:
    """Every group: int8 symmetric weights per output channel, int8 symmetric activations
    quantized per token at run time."""
    if not groups:
        return False
    for g in groups.values():
        w, a = g.get("weights") or {}, g.get("input_activations") or {}
        if (w.get("num_bits"), w.get("type"), w.get("strategy"), w.get("symmetric", True)) != (
                8, "int", "channel", True):
            return False
        if (a.get("num_bits"), a.get("type"), a.get("strategy"), bool(a.get("dynamic")),
                a.get("symmetric", True)) != (8, "int", "token", True, True):
            return False
    return True


def _compressed_tensors(qc: dict) -> Detected:
    groups = qc.get("config_groups") or {}
    fmt = qc.get("format", "")
    if _int8_w8a8(groups):
        return Detected("w8a8_int8", f"compressed-tensors {fmt or 'int-quantized'} W8A8 int8")
    weights = [(g.get("weights") or {}) for g in groups.values()]
    if weights and all(w.get("type") == "float" and w.get("num_bits") == 8 for w in weights):
        return Detected("fp8", f"compressed-tensors {fmt} FP8 weights")
    scheme = ", ".join(sorted({f"{w.get('type')}{w.get('num_bits')} {w.get('strategy')}"
                               for w in weights})) or "no config groups"
    return Detected("compressed-tensors", f"compressed-tensors {fmt} ({scheme})")


def _from_config(folder: str) -> Detected | None:
    path = os.path.join(folder, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return None
    qc = cfg.get("quantization_config") or cfg.get("compression_config")
    if not isinstance(qc, dict):
        return None
    method = str(qc.get("quant_method", "")).lower()
    found = _compressed_tensors(qc) if method == "compressed-tensors" else (
        Detected("fp8", "fp8" + (f" weight blocks {qc['weight_block_size']}"
                                 if qc.get("weight_block_size") else " per tensor"))
        if method == "fp8" else Detected(method or "unknown", f"quant_method {method!r}"))
    return Detected(found.name, found.detail, path)


def _from_modelslim(folder: str) -> Detected | None:
    path = os.path.join(folder, MODELSLIM_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            desc = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: cannot read msModelSlim's description ({e})") from None
    # the per-tensor entries (other keys: model_quant_type, version, ...)
    kinds = sorted({v for k, v in desc.items() if isinstance(v, str) and v != "FLOAT"
                    and k.endswith(".weight")}) if isinstance(desc, dict) else []
    group = desc.get("group_size") if isinstance(desc, dict) else None
    per_group = f" (group_size {group})" if isinstance(group, int) and group > 0 else ""
    return Detected("modelslim", "msModelSlim " + (", ".join(kinds) or "no quantized tensors")
                    + per_group, path)


# GGUF metadata value types (the format's spec): fixed sizes; 8 string, 9 array
_GGUF_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1",
                    10: "Q2_K", 11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S",
                    15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K", 32: "BF16"}
_GGUF_MAX_KEYS = 4096


def gguf_skip_value(f, vtype: int) -> None:
    """Move the open GGUF file `f` past one metadata value of type `vtype`."""
    if vtype in _GGUF_SIZES:
        f.seek(_GGUF_SIZES[vtype], os.SEEK_CUR)
    elif vtype == 8:
        (n,) = struct.unpack("<Q", f.read(8))
        f.seek(n, os.SEEK_CUR)
    elif vtype == 9:
        item, count = struct.unpack("<IQ", f.read(12))
        if item in _GGUF_SIZES:
            f.seek(count * _GGUF_SIZES[item], os.SEEK_CUR)
        else:
            for _ in range(count):
                gguf_skip_value(f, item)
    else:
        raise ValueError(f"unknown GGUF value type {vtype}")


def gguf_file_type(path: str) -> str:
    """`general.file_type` of a GGUF header as llama.cpp names it (Q4_1, ...), read without
    mapping the file (the metadata before it is skipped value by value); 'unknown' when the
    header has none."""

    try:
        with open(path, "rb") as f:
            magic, version = f.read(4), struct.unpack("<I", f.read(4))[0]
            if magic != b"GGUF" or version < 2:
                return "unknown"
            _tensors, nkeys = struct.unpack("<QQ", f.read(16))
            for _ in range(min(nkeys, _GGUF_MAX_KEYS)):
                (n,) = struct.unpack("<Q", f.read(8))
                key = f.read(n).decode("utf-8", "replace")
                (vtype,) = struct.unpack("<I", f.read(4))
                if key == "general.file_type" and vtype in (4, 5):
                    code = struct.unpack("<I", f.read(4))[0]
                    return _GGUF_FILE_TYPES.get(code, f"type {code}")
                gguf_skip_value(f, vtype)
    except (OSError, struct.error, ValueError):
        pass
    return "unknown"


def detect(path: str, gguf_file: str | None) -> Detected:
    """The quantization the checkpoint at `path` (a folder; `gguf_file` inside it for GGUF)
    carries."""
    if gguf_file:
        full = os.path.join(path, gguf_file)
        return Detected("gguf", f"GGUF {gguf_file_type(full)}", full)
    return _from_config(path) or _from_modelslim(path) or Detected(None)


def _check_modelslim(found: Detected, where: str) -> None:
    schemes = found.detail.split(" ", 1)[1].split(" (")[0].split(", ")
    if not set(schemes) <= MODELSLIM_RUNS:
        raise ConfigError(f"{where} is quantized as modelslim ({found.detail}, read from "
                          f"{found.source}); of msModelSlim's schemes pdserve runs "
                          f"{', '.join(sorted(MODELSLIM_RUNS))} only; it runs {_runs()}")
    if "group_size" in found.detail:
        raise ConfigError(f"{where} is quantized as modelslim ({found.detail}, read from "
                          f"{found.source}): per-group W4A8 scales are not run (neither "
                          "vllm-ascend nor pdserve takes them); give a per-channel "
                          "(group_size 0) W4A8 checkpoint")


def _runs() -> str:
    return "; ".join(f"{k} ({v})" for k, v in RUNS.items())


def resolve(flag: str | None, found: Detected, where: str) -> str | None:
    """The quantization to serve with: the checkpoint's, checked against `--quantization`
    (`flag`); ConfigError naming the format and the ones pdserve runs when it is not one of
    them, or when the flag and the checkpoint disagree. `where`: the model, for messages."""
    if flag is not None and flag not in QUANT_CHOICES:
        raise ConfigError(f"--quantization {flag}: not a quantization method SGLang or pdserve "
                          f"knows; pdserve runs {_runs()}")
    if flag == "unquant":
        flag = None if found.name is None else flag
    if found.name is None:
        if flag is None:
            return None
        if flag in RUNS:
            raise ConfigError(
                f"--quantization {flag}: {where} is not quantized (its config.json has no "
                "quantization_config) and pdserve does not quantize at load; give a "
                f"checkpoint quantized so, or drop the flag to serve it in --dtype")
        raise ConfigError(f"--quantization {flag}: pdserve does not run this format; it runs "
                          f"{_runs()}")
    if found.name == "modelslim":
        _check_modelslim(found, where)
    if found.name not in RUNS:
        named = f"--quantization {flag}: " if flag else ""
        raise ConfigError(f"{named}{where} is quantized as {found.name} ({found.detail}, read "
                          f"from {found.source}), which pdserve does not run yet; it runs "
                          f"{_runs()}")
    ct = flag == "compressed-tensors" and found.detail.startswith("compressed-tensors")
    if flag is not None and ALIASES.get(flag) != found.name and not ct:
        raise ConfigError(f"--quantization {flag} does not match {where}, which is quantized as "
                          f"{found.name} ({found.detail}, read from {found.source}); drop the "
                          f"flag or give --quantization {found.name}")
    return found.name


def checked_quantization(flag: str | None, model_path: str | None) -> str | None:
    """The quantization the model at `model_path` is served with (`resolve` of what `detect`
    reads); ConfigError for a format pdserve does not run or a flag the checkpoint contradicts."""
    from pdcore.engine.model.source import resolve_model

    resolved = resolve_model(model_path)
    return resolve(flag, detect(resolved.path, resolved.gguf_file), resolved.display_path)


def checked_draft_quantization(flag: str | None, draft_path: str | None,
                               model_path: str | None) -> str | None:
    """`--speculative-draft-model-quantization` (`flag`) by the same rules as `--quantization`,
    for the draft head's checkpoint: `draft_path` (--speculative-draft-model-path), else the
    target's own folder (NEXTN's MTP layer, a MiMo's MTP layers). The head's loader reads its
    weights as this detection finds them (fp8.quantized_weights). `unquant` (SGLang's "the
    draft runs unquantized") on a separate draft folder must find it float; on the target's own
    folder the head's tensors are read as that checkpoint holds them."""
    from pdcore.engine.model.source import resolve_model

    own = not draft_path
    if not own and not os.path.exists(draft_path):
        raise ConfigError(f"--speculative-draft-model-path {draft_path} does not exist (model "
                          "hubs are not used: give a local HF folder)")
    resolved = resolve_model(model_path if own else draft_path)
    found = detect(resolved.path, resolved.gguf_file)
    if flag == "unquant" and own:
        flag = None
    return resolve(flag, found, f"the draft model {resolved.display_path}")
