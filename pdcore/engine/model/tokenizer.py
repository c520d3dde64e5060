"""Tokenizer loading (transformers, or thin_tokenizer in the HTTP process); where the model is:
pdcore.engine.model.source (its names are importable from here too)."""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from pdcore.engine.model.source import (  # noqa: F401 - re-exported: the model's location
    DEFAULT_MODEL_FILE,
    DEFAULT_MODEL_PACKAGE,
    INSTALL_HINT,
    ResolvedModel,
    default_model_file,
    resolve_model,
)
from pdcore.errors import ModelLoadError

log = logging.getLogger(__name__)

# tokenizer_config.json classes that are exactly the generic `tokenizers` backend: loaded
# directly, they keep the process free of torch (see _light_tokenizer)
_GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _light_tokenizer(folder: str) -> Any | None:
    """The tokenizer of `folder` without AutoTokenizer, or None when that does not apply.

    AutoTokenizer reads the model config through transformers' config module, which imports
    torch (~300 MiB resident in the HTTP frontend, which never runs a tensor op). A folder whose
    tokenizer_config.json names the generic `tokenizers` backend and ships tokenizer.json loads
    the same class directly, chat template and special tokens included; any other class goes
    through AutoTokenizer as before."""
    try:
        with open(os.path.join(folder, "tokenizer_config.json"), encoding="utf-8") as f:
            cls = json.load(f).get("tokenizer_class")
    except (OSError, ValueError):
        return None
    if cls not in _GENERIC_CLASSES or not os.path.isfile(os.path.join(folder, "tokenizer.json")):
        return None
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    return TokenizersBackend.from_pretrained(folder)


def load_tokenizer(args: Any, thin: bool = False) -> Any:
    """The tokenizer (with chat template) for args.tokenizer_path or model_path: transformers',
    or with `thin` (the HTTP process) thin_tokenizer's where it reproduces transformers' exactly
    (logged either way, with the reason transformers is needed)."""
    from pdcore.engine.model.gguf_cache import converted

    resolved = converted(resolve_model(getattr(args, "tokenizer_path", None) or args.model_path))
    remote = bool(getattr(args, "trust_remote_code", False))
    slow = getattr(args, "tokenizer_mode", "auto") == "slow"  # --tokenizer-mode slow
    try:
        tokenizer = None
        if thin:
            why = ("--trust-remote-code" if remote else "--tokenizer-mode slow" if slow
                   else "a GGUF file" if resolved.gguf_file else "")
            if not why:
                from pdcore.engine.model.thin_tokenizer import thin_tokenizer

                tokenizer, why = thin_tokenizer(resolved.path)
            if tokenizer is not None:
                log.info("tokenizer: thin (tokenizers + jinja2, no transformers) from %s",
                         resolved.display_path)
            else:
                log.info("tokenizer: transformers from %s (the thin one cannot: %s)",
                         resolved.display_path, why)
        if tokenizer is None and not (remote or slow or resolved.gguf_file):
            tokenizer = _light_tokenizer(resolved.path)
        if tokenizer is None:
            from transformers import AutoTokenizer

            kw = {"use_fast": False} if slow else {}
            tokenizer = AutoTokenizer.from_pretrained(resolved.path, trust_remote_code=remote,
                                                      **resolved.hf_kwargs(), **kw)
    except Exception as e:
        raise ModelLoadError(f"cannot load tokenizer from {resolved.display_path}: {e}") from e
    template = getattr(args, "chat_template", None)
    if template:  # --chat-template: /v1/chat/completions renders with this file instead
        try:
            with open(os.path.expanduser(template), encoding="utf-8") as f:
                tokenizer.chat_template = f.read()
        except OSError as e:
            raise ModelLoadError(f"cannot read --chat-template {template}: {e}") from e
    return tokenizer
