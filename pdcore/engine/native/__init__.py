"""Native (C++) pieces of the engine, compiled on first use against the installed torch
(decode_step.cpp with the headers beside it: gemm.h, attention.h, elementwise.h, common.h):

- `pdcore_native::linear` / `linear_bf16`: float32 / bf16 GEMM over weight panels (the layout
  `pack_panels` / `pack_panels_bf16` make once at load, replacing the original weight),
  AVX-512 (BF16) kernels that read each weight byte once per decode step; models/layers.py
  routes a weight through them where they measured faster than oneDNN at load;
- `pdcore_native::decode_attention`: one query token per sequence against the decode K/V view;
- `pdcore_native::rope_store`: rotary over q and k with the K/V pool store, in one pass (equal
  to the bit to the aten operators); `silu_mul`: bf16 silu(gate) * up in one pass;
- `pdcore_native::decode_layers`: a Llama-family decode step's layer loop, the same operators
  in the same order as the Python loop in models/llama.py (equal to the bit); what it saves is
  the interpreter between ~25 small operators a layer.

Built with the host's C++ compiler (g++ with OpenMP; no ninja, no Python headers: the library
registers torch operators and nothing else) into ~/.cache/pdserve/native (PDSERVE_NATIVE_DIR),
keyed by the sources, the torch version and the flags (the ABI among them), in ~15 s once per
machine; concurrent builders each write a temporary file and rename it. Where it cannot be
built (no compiler), the CPU lacks AVX-512 (the panel GEMM; oneDNN's reordered weights serve
instead), or with PDCORE_NATIVE=0, the engine runs as before and `status()` says why (logged
once; the engine's stats carry it to /metrics).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import torch

from pdcore.config import env_bool

log = logging.getLogger(__name__)

ENV = "PDCORE_NATIVE"
DIR_ENV = "PDSERVE_NATIVE_DIR"
SOURCE = Path(__file__).with_name("decode_step.cpp")  # includes the headers beside it
BUILD_TIMEOUT_S = 300

_lock = threading.Lock()
# "ops": the operator namespace or None, "why": the reason it is None, "panel" / "bf16": whether
# the float32 / bf16 panel GEMMs serve (each resolved on first use)
_state: dict[str, object] = {}


def _cache_dir() -> Path:
    raw = os.environ.get(DIR_ENV, "").strip()
    return Path(raw) if raw else Path.home() / ".cache" / "pdserve" / "native"


def _command(out: Path) -> list[str]:
    # torch's headers and libraries from its own folder (torch.utils.cpp_extension would say
    # the same, but imports setuptools, which a fresh virtual environment may lack)
    root = Path(torch.__file__).parent
    inc, lib = root / "include", root / "lib"
    cxx = os.environ.get("CXX", "").strip() or "g++"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    # -fopenmp: at::parallel_for is inline OpenMP; the library binds to the libgomp torch has
    # already loaded (same soname), so there is one thread pool. -ffp-contract=off: a * b + c
    # rounds twice, as aten's elementwise operators do (the fused rotary is equal to the bit;
    # explicit FMA intrinsics stay FMAs)
    return [cxx, "-O3", "-shared", "-fPIC", "-std=c++17", "-w", "-fopenmp", "-ffp-contract=off",
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-I{inc}", f"-I{inc / 'torch/csrc/api/include'}",
            str(SOURCE), f"-L{lib}", "-lc10", "-ltorch_cpu", "-o", str(out)]


def _build() -> Path:
    """The compiled library, built now if this source and torch have none yet."""
    cmd = _command(Path("out.so"))
    # the key: the source, torch's version and the flags (not where torch is installed: each
    # CI run's fresh virtual environment would add a copy)
    flags = [a for a in cmd[:-1] if not a.startswith(("-I", "-L", "/"))]
    sources = b"".join(f.read_bytes() for f in [SOURCE, *sorted(SOURCE.parent.glob("*.h"))])
    key = hashlib.sha256(sources + torch.__version__.encode()
                         + " ".join(flags).encode()).hexdigest()[:16]
    target = _cache_dir() / f"decode_step-{key}.so"
    if target.exists():
        return target
    if shutil.which(cmd[0]) is None:
        raise RuntimeError(f"no C++ compiler ({cmd[0]!r} is not on PATH; apt-get install g++)")
    target.parent.mkdir(parents=True, exist_ok=True)
    _sweep(target.parent)
    fd, tmp = tempfile.mkstemp(prefix="building-", suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        cmd[-1] = tmp
        log.info("building the native decode step (once per machine, ~15 s): %s", target)
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S,
                           check=False)
        if r.returncode != 0:
            raise RuntimeError(f"{cmd[0]} failed (exit {r.returncode}): {r.stderr.strip()[-800:]}")
        os.replace(tmp, target)  # atomic: a concurrent builder's copy is the same bytes
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def ops():
    """The torch.ops.pdcore_native namespace, built and loaded on first call; None where it
    cannot be (then `status()` says why)."""
    with _lock:
        if "ops" not in _state:
            _state["ops"], _state["why"] = None, ""
            if not env_bool(os.environ, ENV, True):
                _state["why"] = f"{ENV}=0"
            else:
                try:
                    torch.ops.load_library(str(_build()))
                    _state["ops"] = torch.ops.pdcore_native
                except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                    _state["why"] = str(e)
                    log.warning("native kernels unavailable, the Python decode loop and oneDNN "
                                "GEMMs run: %s", e)
        return _state["ops"]


def _sweep(folder: Path) -> None:
    """Drop what builders killed mid-build left behind (older than two build timeouts)."""
    now = time.time()
    for f in folder.glob("building-*.so"):
        try:
            if now - f.stat().st_mtime > 2 * BUILD_TIMEOUT_S:
                f.unlink()
        except OSError:
            pass


def op(name: str):
    """The operator torch.ops.pdcore_native.<name>, or None where the kernels are not built."""
    o = ops()
    return None if o is None else getattr(o, name)


def panel_gemm() -> bool:
    """Whether float32 linear layers take the panel GEMM (built, and the CPU has AVX-512)."""
    if "panel" not in _state:
        o = ops()
        _state["panel"] = o is not None and bool(o.panel_gemm_supported())
        if o is not None and not _state["panel"]:
            log.info("the CPU lacks AVX-512: float32 GEMMs run on oneDNN's reordered weights")
    return bool(_state["panel"])


def bf16_gemm() -> bool:
    """Whether bf16 linear layers take the bf16 panel GEMM (built, and AVX-512 BF16)."""
    if "bf16" not in _state:
        o = ops()
        _state["bf16"] = o is not None and bool(o.bf16_gemm_supported())
    return bool(_state["bf16"])


def status() -> str:
    """'native', or why the engine runs without it ('' before the first use)."""
    if "ops" not in _state:
        return ""
    if _state["ops"] is None:
        return f"off ({_state['why']})"
    return "native" if _state.get("panel", True) else "native (no panel GEMM: no AVX-512)"
