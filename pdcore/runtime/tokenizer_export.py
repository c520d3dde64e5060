"""A tokenizer folder for routers: sglang-router loads the worker's `tokenizer_path` with
HF tokenizers, and a GGUF file is not one. We export the tokenizer (chat template included) to
a stable temp folder keyed by the model file, shared by every server of that model."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from typing import Any

log = logging.getLogger(__name__)


def tokenizer_dir(tokenizer: Any, path: str | None) -> str | None:
    """A local folder with the tokenizer files for routers that load `tokenizer_path`
    (sglang-router): `path` itself when it is one, else (a GGUF) an exported copy."""
    if path and os.path.isdir(path) and any(
            os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer.model")):
        return path
    if tokenizer is None or not hasattr(tokenizer, "save_pretrained"):
        return path
    key = hashlib.sha1(f"{path}:{_mtime(path)}".encode()).hexdigest()[:16]
    dest = os.path.join(tempfile.gettempdir(), "pdserve-tokenizers", key)
    if not os.path.isfile(os.path.join(dest, "tokenizer_config.json")):
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=key + ".", dir=os.path.dirname(dest))
        try:
            tokenizer.save_pretrained(tmp)
            os.replace(tmp, dest)  # atomic: concurrent servers may export the same one
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if not os.path.isdir(dest):
                log.warning("could not export the tokenizer for routers: %s", e)
                return path
    return dest


def _mtime(path: str | None) -> float:
    try:
        return os.path.getmtime(path) if path else 0.0
    except OSError:
        return 0.0
