"""Starting the systems bench/vs_vllm.py compares, each as a group of processes stopped together:
pdserve unified / 1P1D (`pdserve up`), vLLM unified, vLLM 1P1D (two `vllm serve` joined by
NixlConnector plus bench/vllm_pd_proxy.py), and the SmolLM2 float32 HF folder vLLM needs.

vLLM settings follow shared/reference/vllm-cpu.md. Its KV cache is a fixed reservation
(VLLM_CPU_KVCACHE_SPACE GiB per server): the benchmark holds at most concurrency x (input +
output) tokens, a few MB for SmolLM2, so 1 GiB (--vllm-kv-gib) changes no timing and keeps two
vLLM servers within memory on a shared box.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

BENCH = Path(__file__).resolve().parent
VLLM_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
            "VLLM_TARGET_DEVICE": "cpu", "VLLM_HOST_IP": "127.0.0.1", "UCX_NET_DEVICES": "lo",
            "UCX_TLS": "tcp,sm,self", "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
            # vLLM 0.32 with torch 2.13 saves its AOT-compiled model in a form it then fails to
            # load ('function' object has no attribute 'finalize_loading'), so every start
            # recompiles (~2.5 min on a loaded 2-core box). Without AOT compile it loads its
            # cached graphs instead (warm-up 21 s there); the kernels are the same inductor
            # output, only start-up changes.
            "VLLM_USE_AOT_COMPILE": "0"}
NIXL_CONFIG = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
SERVED_NAME = "model"
# NIXL side-channel ports of the prefill / decode server. Fixed, not free ports picked per run:
# vLLM hashes this variable into its torch.compile cache key, so a new port every run would
# recompile the model (minutes) on every start.
SIDE_PORTS = (5600, 5601)


class Proc:
    """One server (or `pdserve up`) in its own process group, output in a temp log file."""

    def __init__(self, argv: list[str], url: str, env: dict[str, str] | None = None,
                 name: str = "") -> None:
        self.url, self.name = url, name or Path(argv[0]).name
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - closed in stop()
            prefix=f"vs_vllm-{self.name}-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})}, start_new_session=True)

    def ready(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; "
                               f"log {self.log.name}")
        try:
            return httpx.get(self.url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        else:
            # the leader is gone; children it left in the group (vLLM's engine core) are not
            with _ignore(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.log.close()


class _ignore:
    def __init__(self, *exc: type[BaseException]) -> None:
        self.exc = exc

    def __enter__(self) -> None:
        return None

    def __exit__(self, t: object, e: object, tb: object) -> bool:
        return t is not None and issubclass(t, self.exc)  # type: ignore[arg-type]


class Group:
    """The processes of one system; `url` is where the client talks (the last one started)."""

    def __init__(self) -> None:
        self.procs: list[Proc] = []

    def add(self, proc: Proc) -> Proc:
        self.procs.append(proc)
        return proc

    @property
    def url(self) -> str:
        return self.procs[-1].url

    def wait_ready(self, timeout: float) -> float:
        """Seconds until every process answers /health; raises (naming the log) otherwise."""
        t0 = time.monotonic()
        pending = list(self.procs)
        while pending:
            pending = [p for p in pending if not p.ready()]
            if pending and time.monotonic() - t0 > timeout:
                raise RuntimeError(f"{pending[0].name} not ready after {timeout:.0f}s; "
                                   f"log {pending[0].log.name}")
            if pending:
                time.sleep(1)
        return time.monotonic() - t0

    def logs(self) -> list[str]:
        return [p.log.name for p in self.procs]

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()


def free_port() -> int:
    from pdcore.testing.processes import free_port as fp

    return fp()


def vllm_bin(vllm_python: str) -> str:
    return str(Path(vllm_python).parent / "vllm")


def vllm_serve(vllm_python: str, model: str, dtype: str, port: int, bind: str, kv_gib: int,
               extra_env: dict[str, str] | None = None, extra: list[str] | None = None,
               name: str = "vllm", max_model_len: int = 2048) -> Proc:
    argv = [vllm_bin(vllm_python), "serve", model, "--dtype", dtype, "--host", "127.0.0.1",
            "--port", str(port), "--max-model-len", str(max_model_len),
            "--served-model-name", SERVED_NAME,
            *(extra or [])]
    env = {**VLLM_ENV, "VLLM_CPU_KVCACHE_SPACE": str(kv_gib), "VLLM_CPU_OMP_THREADS_BIND": bind,
           **(extra_env or {})}
    return Proc(argv, f"http://127.0.0.1:{port}", env, name)


def check_free(port: int) -> None:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError as e:
            raise RuntimeError(f"port {port} is taken ({e}); pick other --vllm-side-ports") from e


def start_system(system: str, model: str, dtype: str, vllm_python: str | None, vllm_bind: str,
                 kv_gib: int, side_ports: tuple[int, int] = SIDE_PORTS,
                 max_model_len: int = 2048, pdserve_flags: tuple[str, ...] = ()) -> Group:
    """`pdserve_flags`: more `pdserve serve` flags for pdserve's systems (e.g. --quantization);
    vLLM reads a checkpoint's quantization from its config."""
    g, py, port = Group(), sys.executable, free_port()
    if system == "pdserve-unified":
        g.add(Proc([py, "-m", "pdcore", "serve", "--host", "127.0.0.1", "--port", str(port),
                    "--dtype", dtype, "--model-path", model, *pdserve_flags],
                   f"http://127.0.0.1:{port}", name="pdserve"))
    elif system == "pdserve-1p1d":
        g.add(Proc([py, "-m", "pdcore", "up", "--port", str(port), "--server-port-base",
                    str(free_port()), "--bootstrap-port-base", str(free_port()),
                    "--model-path", model, "--dtype", dtype, *pdserve_flags],
                   f"http://127.0.0.1:{port}", name="pdserve-up"))
    elif system == "vllm-unified":
        assert vllm_python
        g.add(vllm_serve(vllm_python, model, dtype, port, vllm_bind, kv_gib,
                         max_model_len=max_model_len))
    elif system == "vllm-1p1d":
        assert vllm_python
        kv = ["--kv-transfer-config", json.dumps(NIXL_CONFIG)]
        urls = []
        for i, (role, cpu) in enumerate((("prefill", "0"), ("decode", "1"))):
            p = port if i == 0 else free_port()
            check_free(side_ports[i])
            side = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_ports[i])}
            urls.append(g.add(vllm_serve(vllm_python, model, dtype, p, cpu, kv_gib, side, kv,
                                         name=f"vllm-{role}", max_model_len=max_model_len)).url)
        pp = free_port()
        g.add(Proc([py, str(BENCH / "vllm_pd_proxy.py"), "--port", str(pp), "--prefill",
                    urls[0], "--decode", urls[1]], f"http://127.0.0.1:{pp}",
                   name="vllm-pd-proxy"))
    else:
        raise ValueError(f"unknown system {system!r}")
    return g


def make_hf_folder(dest: Path) -> Path:
    """The default SmolLM2 GGUF as a float32 HF folder at `dest` (for vLLM and pdserve alike):
    pdserve's GGUF cache already writes exactly that conversion, so copy its folder."""
    if (dest / "config.json").is_file() and (dest / "model.safetensors").is_file():
        return dest
    from pdcore.engine.model.gguf_cache import converted
    from pdcore.engine.model.tokenizer import resolve_model

    src = converted(resolve_model(None))
    if src.gguf_file:
        raise RuntimeError("the GGUF cache is off or unusable (PDCORE_GGUF_CACHE); cannot make "
                           "an HF folder")
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src.path, tmp)
    legacy_config_keys(tmp / "config.json")
    os.rename(tmp, dest)
    return dest


# Llama-3.2-1B's shape (hidden 2048, 16 layers, 32 query / 8 KV heads of 64, MLP 8192, tied
# embeddings) with SmolLM2's tokenizer and vocabulary (49152 instead of 128256: random greedy
# output must stay decodable by the tokenizer both servers load), default rotary (no llama3
# frequency scaling: the cost is the same), a 32k window (issue #47's 16k-token prompts; the
# real model's is 128k). 1.07 B parameters, 4.3 GB as float32.
LLAMA_1B_SHAPE = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                  "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
                  "max_position_embeddings": 32768, "tie_word_embeddings": True}


def make_llama_1b_folder(dest: Path, seed: int = 0) -> Path:
    """A Llama-3.2-1B-shaped model with random weights (std 0.02) as a float32 HF folder."""
    if (dest / "config.json").is_file() and any(dest.glob("*.safetensors")):
        return dest
    import torch
    import transformers

    from pdcore.engine.model.tokenizer import resolve_model

    r = resolve_model(None)
    tok = transformers.AutoTokenizer.from_pretrained(r.path, **r.hf_kwargs())
    cfg = transformers.LlamaConfig(
        vocab_size=len(tok), **LLAMA_1B_SHAPE, initializer_range=0.02,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).to(torch.float32).eval()
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    legacy_config_keys(tmp / "config.json")
    os.rename(tmp, dest)
    return dest


def legacy_config_keys(path: Path) -> None:
    """Add the pre-5.x spellings (rope_theta, torch_dtype) beside the new ones: vLLM pins its own
    transformers, and one older than 5.x ignores `rope_parameters` and silently uses the default
    rope theta (wrong logits at the same speed; the bench's greedy probe would show it)."""
    cfg = json.loads(path.read_text())
    rope = cfg.get("rope_parameters") or {}
    if "rope_theta" in rope:
        cfg.setdefault("rope_theta", rope["rope_theta"])
    if "dtype" in cfg:
        cfg.setdefault("torch_dtype", cfg["dtype"])
    path.write_text(json.dumps(cfg, indent=2) + "\n")
