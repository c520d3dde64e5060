"""A GGUF model converted once into a float32 HF folder, so later starts skip the GGUF parse.

transformers reads a GGUF file slowly: every `from_pretrained` (config, weights, tokenizer) parses
the whole metadata block again, string by string, and maps tensor names (measured here: ~20 s of
CPU per server start for SmolLM2-135M, against ~2 s for the same weights as safetensors). A
server therefore loads a GGUF model through a cached conversion:

    <cache>/gguf/<file stem>-<key>/  config.json, model.safetensors (float32), tokenizer files

- <cache> is $PDCORE_CACHE_DIR, else $XDG_CACHE_HOME/pdserve, else ~/.cache/pdserve;
- <key> hashes the file's CONTENT (sha256), the transformers version and FORMAT, so an edited
  file or another transformers gives a new folder, while the same file at another path (each
  virtual environment installs its own copy of a packaged model) reuses the folder: keyed by
  path and mtime, every new environment converted again (~22 s) and left another 540 MiB folder
  behind. Hashing the file (~0.3 s per 100 MB) happens once per path, size and mtime: the digest
  is kept in <cache>/gguf/.digests/;
- after a conversion, folders of the older path-keyed scheme whose GGUF is gone are removed;
- the first server converts under an exclusive lock (others wait for it, up to LOCK_TIMEOUT_S),
  in a temporary folder renamed into place when complete: a half-written folder is never used;
- PDCORE_GGUF_CACHE=0 loads the GGUF directly every time. If the cache cannot be written (read-only
  home, full disk) the server logs why and loads the GGUF directly.

The weights are the same dequantised float32 tensors either way (a test compares them); only the
file they are read from changes.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from pdcore.env import ENV, Env, child_environ
from pdcore.engine.model.source import ResolvedModel

log = logging.getLogger(__name__)

CACHE_ENV = Env.pdcore_gguf_cache.name
DIR_ENV = Env.pdcore_cache_dir.name
FORMAT = 1
DONE = "pdserve-converted.json"
LOCK_TIMEOUT_S = 900.0


def enabled() -> bool:
    return ENV.pdcore_gguf_cache


def cache_root() -> Path:
    if ENV.pdcore_cache_dir:
        return Path(ENV.pdcore_cache_dir).expanduser()
    base = ENV.xdg_cache_home or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pdserve"


def content_digest(gguf: Path) -> str:
    """sha256 of the file's bytes, computed once per (real path, size, mtime) and remembered
    under <cache>/gguf/.digests/ (an unwritable cache only means hashing again next time)."""
    st = gguf.stat()
    stat_key = hashlib.sha256(f"{gguf.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode())
    memo = cache_root() / "gguf" / ".digests" / stat_key.hexdigest()[:32]
    with contextlib.suppress(OSError):
        digest = memo.read_text().strip()
        if len(digest) == 64:
            return digest
    h = hashlib.sha256()
    with open(gguf, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    digest = h.hexdigest()
    with contextlib.suppress(OSError):
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_name(f".{memo.name}.{os.getpid()}")
        tmp.write_text(digest + "\n")
        os.replace(tmp, memo)
    return digest


def folder_for(gguf: Path) -> Path:
    # the installed version from its metadata: importing transformers to ask costs the engine
    # ~25 MiB resident that nothing else there needs
    from importlib.metadata import version

    key = hashlib.sha256(f"{content_digest(gguf)}|{version('transformers')}|{FORMAT}".encode())
    return cache_root() / "gguf" / f"{gguf.stem}-{key.hexdigest()[:16]}"


def prune_stale(root: Path) -> list[Path]:
    """Remove the folders of the older path-keyed scheme (their marker names no content digest)
    whose GGUF file is gone: nothing can key them again. Returns what was removed."""
    gone = []
    for marker in root.glob(f"*/{DONE}"):
        try:
            done = json.loads(marker.read_text())
        except (OSError, ValueError):
            continue
        source = done.get("source")
        if "content" in done or not isinstance(source, str) or os.path.exists(source):
            continue
        shutil.rmtree(marker.parent, ignore_errors=True)
        with contextlib.suppress(OSError):
            marker.parent.with_name(marker.parent.name + ".lock").unlink()
        gone.append(marker.parent)
    if gone:
        log.info("GGUF cache: removed %d folder(s) of GGUF files that no longer exist: %s",
                 len(gone), ", ".join(p.name for p in gone))
    return gone


@contextlib.contextmanager
def _locked(path: Path, timeout: float) -> Iterator[None]:
    with open(path, "a+") as f:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{path} stayed locked for {timeout:.0f}s "
                                       f"(another server converting?)") from None
                time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _convert(resolved: ResolvedModel, dest: Path) -> None:
    """Convert in a child process and wait for it. Loading the transformers model to convert
    leaves the converting process holding its freed heap and transformers' model machinery: the
    HTTP process, which converts when it loads the tokenizer on a machine's first start, stayed
    at 595 MiB resident against 152 MiB when the folder was already there (SmolLM2), for as long
    as the server ran. The child takes all of that with it when it exits."""
    import subprocess
    import sys

    t0 = time.monotonic()
    log.info("converting %s to a float32 HF folder at %s (once; later starts read it)",
             resolved.display_path, dest)
    job = json.dumps({"model": [resolved.path, resolved.gguf_file, resolved.name,
                                resolved.source], "dest": str(dest)})
    # the child imports this very pdcore (and whatever else the parent found) first
    env = child_environ({"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)})
    r = subprocess.run([sys.executable, "-m", __name__, job], env=env, capture_output=True,
                       text=True, timeout=LOCK_TIMEOUT_S, check=False)
    if r.returncode != 0:
        raise RuntimeError(f"the conversion exited {r.returncode}: {r.stderr.strip()[-800:]}")
    log.info("converted in %.1fs", time.monotonic() - t0)


def _convert_here(resolved: ResolvedModel, dest: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        kw = resolved.hf_kwargs()
        model = AutoModelForCausalLM.from_pretrained(resolved.path, dtype=torch.float32, **kw)
        # save_pretrained refuses a model loaded from GGUF: write config and tensors ourselves
        cfg = model.config
        if hasattr(cfg, "quantization_config"):
            del cfg.quantization_config
        cfg.save_pretrained(tmp)
        sd = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
        if getattr(cfg, "tie_word_embeddings", False):
            sd.pop("lm_head.weight", None)  # the same tensor as the embedding
        save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        del model, sd
        AutoTokenizer.from_pretrained(resolved.path, **kw).save_pretrained(tmp)
        done = {"source": resolved.display_path, "format": FORMAT,
                "content": content_digest(Path(resolved.display_path))}
        (tmp / DONE).write_text(json.dumps(done) + "\n")
        os.rename(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def converted(resolved: ResolvedModel) -> ResolvedModel:
    """`resolved` itself unless it is a GGUF file and the cache is on; then the cached HF folder
    (converting first if needed). Any failure to use the cache falls back to `resolved`."""
    if not resolved.gguf_file or not enabled():
        return resolved
    gguf = Path(resolved.display_path)
    try:
        dest = folder_for(gguf)
        if not (dest / DONE).is_file():
            dest.parent.mkdir(parents=True, exist_ok=True)
            with _locked(dest.parent / f"{dest.name}.lock", LOCK_TIMEOUT_S):
                if not (dest / DONE).is_file():
                    _convert(resolved, dest)
                    prune_stale(dest.parent)
    except Exception as e:  # noqa: BLE001 - the cache is an optimisation, never a failure
        log.warning("GGUF cache unusable (%s: %s); loading %s directly (set %s=0 to skip the "
                    "cache)", type(e).__name__, e, gguf, CACHE_ENV)
        return resolved
    return ResolvedModel(str(dest), None, resolved.name, source=resolved.display_path)


if __name__ == "__main__":  # the child of _convert
    import sys

    _job = json.loads(sys.argv[1])
    _convert_here(ResolvedModel(*_job["model"]), Path(_job["dest"]))
