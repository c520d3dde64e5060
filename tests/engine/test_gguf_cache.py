"""The GGUF cache: a server loads SmolLM2's GGUF through a float32 HF folder converted once.

The conversion must change nothing the engine sees: same tensors (compared against transformers
reading the GGUF itself), same tokenizer (ids, chat template, special tokens). It must be reused,
never half-used, and must fall back to the GGUF when it cannot be written. Its folder is keyed by
the file's content: the same GGUF installed in another virtual environment reuses it; an
edited one converts anew; folders of the older path-keyed scheme whose GGUF is gone are removed.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch

from pdcore.engine.model import gguf_cache
from pdcore.engine.model.tokenizer import resolve_model
from pdcore.testing.prompts import prompt_token_ids


@pytest.fixture()
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(gguf_cache.DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(gguf_cache.CACHE_ENV, raising=False)
    return tmp_path / "cache"


def test_conversion_keeps_weights_and_tokenizer(cache_dir: Path) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    raw = resolve_model(None)
    conv = gguf_cache.converted(raw)
    assert conv.gguf_file is None and Path(conv.path).parent == cache_dir / "gguf"
    assert conv.display_path == raw.display_path and conv.name == raw.name
    assert (Path(conv.path) / "config.json").is_file()

    saved = load_file(str(Path(conv.path) / "model.safetensors"))
    ref = AutoModelForCausalLM.from_pretrained(  # transformers reading the GGUF itself
        raw.path, dtype=torch.float32, **raw.hf_kwargs()).state_dict()
    if "lm_head.weight" not in saved:  # tied: stored once
        saved["lm_head.weight"] = saved["model.embed_tokens.weight"]
    assert set(saved) == set(ref)
    for name, t in ref.items():
        assert torch.equal(saved[name], t), name

    tok = AutoTokenizer.from_pretrained(conv.path)
    ref_tok = AutoTokenizer.from_pretrained(raw.path, **raw.hf_kwargs())  # from the GGUF itself
    assert prompt_token_ids(tok) == prompt_token_ids(ref_tok)  # raw text and chat template
    assert tok.eos_token_id == ref_tok.eos_token_id and tok.bos_token_id == ref_tok.bos_token_id

    # a second start reuses the folder without converting
    def no_convert(*a, **k):
        raise AssertionError("converted again")

    with pytest.MonkeyPatch.context() as m:
        m.setattr(gguf_cache, "_convert", no_convert)
        assert gguf_cache.converted(raw) == conv


def test_half_written_folder_is_never_used(cache_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                           caplog: pytest.LogCaptureFixture) -> None:
    raw = resolve_model(None)
    dest = gguf_cache.folder_for(Path(raw.display_path))
    dest.mkdir(parents=True)  # a folder without the completion marker
    (dest / "config.json").write_text("{}")

    def failing(resolved, d):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(gguf_cache, "_convert", failing)
    with caplog.at_level(logging.WARNING, logger="pdcore.engine.model.gguf_cache"):
        assert gguf_cache.converted(raw) == raw
    assert "No space left on device" in caplog.text and "loading" in caplog.text


def test_unwritable_cache_falls_back_to_the_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    monkeypatch.setenv(gguf_cache.DIR_ENV, str(blocker / "cache"))
    raw = resolve_model(None)
    with caplog.at_level(logging.WARNING, logger="pdcore.engine.model.gguf_cache"):
        assert gguf_cache.converted(raw) == raw
    assert "GGUF cache unusable" in caplog.text


def test_cache_off_and_hf_folders_pass_through(cache_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                               tmp_path: Path) -> None:
    raw = resolve_model(None)
    monkeypatch.setenv(gguf_cache.CACHE_ENV, "0")
    assert gguf_cache.converted(raw) == raw
    monkeypatch.delenv(gguf_cache.CACHE_ENV)
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    hf = resolve_model(str(folder))
    assert gguf_cache.converted(hf) == hf
    assert not cache_dir.exists()


def test_the_same_gguf_elsewhere_reuses_its_folder(cache_dir: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Two copies (two virtual environments, other mtimes) share one conversion; a copy with one
    byte changed in the middle gets its own; legacy path-keyed folders of deleted files go."""
    src = Path(resolve_model(None).display_path)
    copies = []
    for i, name in enumerate(("venv_a", "venv_b")):
        (tmp_path / name).mkdir()
        copies.append(tmp_path / name / src.name)
        shutil.copyfile(src, copies[-1])
        os.utime(copies[-1], ns=(10**18 + i, 10**18 + i))
    made: list[Path] = []

    def fake_convert(resolved, dest: Path) -> None:  # the marker a conversion writes
        dest.mkdir(parents=True)
        (dest / gguf_cache.DONE).write_text(json.dumps({
            "source": resolved.display_path, "format": gguf_cache.FORMAT,
            "content": gguf_cache.content_digest(Path(resolved.display_path))}))
        made.append(dest)

    monkeypatch.setattr(gguf_cache, "_convert", fake_convert)
    root = cache_dir / "gguf"
    legacy = {}
    for name, source in (("gone", tmp_path / "deleted.gguf"), ("kept", copies[0])):
        legacy[name] = root / f"Legacy-{name}"
        legacy[name].mkdir(parents=True)
        (legacy[name] / gguf_cache.DONE).write_text(json.dumps({"source": str(source),
                                                                 "format": 1}))
    a, b = (gguf_cache.converted(resolve_model(str(c))) for c in copies)
    assert a.path == b.path and len(made) == 1
    assert not legacy["gone"].exists() and legacy["kept"].exists()
    with open(copies[1], "r+b") as f:  # the same size and name, other weights
        f.seek(src.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    edited = gguf_cache.converted(resolve_model(str(copies[1])))
    assert edited.path != a.path and len(made) == 2
    assert gguf_cache.converted(resolve_model(str(copies[0]))).path == a.path  # still there
