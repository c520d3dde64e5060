"""A model's fingerprint: what prefill and decode compare before KV crosses between them.

KV computed by one model is garbage to another with the same shapes (a P restarted with other
weights would make D decode wrong text that looks fine). Hashing the weights themselves takes
seconds per GB, so the fingerprint hashes what identifies them cheaply: config.json's bytes, the
name and size of every weight file, three 64 KiB samples of each (its start, middle and end:
a fine-tuned checkpoint has the same names and sizes but not the same bytes), the load format,
and for random (`dummy`) weights the seed that drew them.
"""

from __future__ import annotations

import hashlib
import os

from pdcore.engine.model.tokenizer import resolve_model

_WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt")
_SAMPLE = 64 << 10


def model_fingerprint(model_path: str | None, load_format: str = "auto",
                      random_seed: int | None = None) -> str:
    """16 hex digits; '' when the model cannot be resolved (the engine reports that itself)."""
    try:
        m = resolve_model(model_path)
    except Exception:  # noqa: BLE001 - a fingerprint must never be why a server fails
        return ""
    h = hashlib.blake2b(digest_size=8)
    h.update(f"format={load_format}".encode())
    if load_format == "dummy":
        h.update(f"seed={random_seed}".encode())
    config = os.path.join(m.path, "config.json")
    if os.path.isfile(config):
        with open(config, "rb") as f:
            h.update(f.read(1 << 20))
    files = [m.gguf_file] if m.gguf_file else sorted(
        f for f in os.listdir(m.path) if f.endswith(_WEIGHT_SUFFIXES))
    for name in files:
        path = os.path.join(m.path, name)
        size = os.path.getsize(path)
        h.update(f"{name}:{size}".encode())
        with open(path, "rb") as f:
            for at in sorted({0, max(0, size // 2 - _SAMPLE // 2), max(0, size - _SAMPLE)}):
                f.seek(at)
                h.update(f.read(_SAMPLE))
    return h.hexdigest()


def draft_identity(args) -> str:
    """Which draft head a server runs, for the pairing (wire.check_chain_head): the algorithm,
    and for a head with weights of its own (EAGLE, EAGLE3) their fingerprint. '' without one."""
    algo, path = args.speculative_algorithm, args.speculative_draft_model_path
    if not algo:
        return ""
    return f"{algo}:{model_fingerprint(path)}" if path else str(algo)
