"""Native (C++) pieces of the engine, compiled on first use against the installed torch
(decode_step.cpp with the headers beside it: gemm.h, panel_gemm.h, bf16_head.h, int8_gemm.h,
int8_act.h, team_step.h, attention.h, prefill_attention.h, bf16_attn.h, attn_block.h,
elementwise.h, common.h and vec.h, the vector layer they are written against):

- `pdcore_native::linear` / `linear_bf16`: float32 / bf16 GEMM over weight panels (the layout
  `pack_panels` / `pack_panels_bf16` make once at load, replacing the original weight), kernels
  that read each weight byte once per decode step (bf16: AVX-512 BF16 only); models/layers.py
  routes a weight through them where they measured faster than oneDNN at load;
  `linear_bf16_f32` (bf16_head.h): float32 x rounded to bf16 against bf16 pair panels,
  float32 out (a W8A8 model's lm_head with PDCORE_W8A8_LM_HEAD=bf16_dot; AVX-512 BF16 only);
  `panel_tuning`: the float32 prefill GEMM's blocking (of K and of rows; a bench's knob);
- `pdcore_native::decode_attention`: one query token per sequence against the decode K/V view;
  `decode_attention_paged`: the same kernel reading the K/V pool in place through the
  sequences' slot table (no view, no gather: contexts past the view's budget, lone decodes);
  both split a long context into parts (flash-decoding) where the (sequence, KV head) tasks
  are fewer than two a thread; every attention path sums in one order (attn_block.h: blocks
  of 64 keys joined in order), so a row has the same bits in prefill, alone, in a decode
  group or in parts (int8 activations would turn a last-bit difference into a whole step);
- `pdcore_native::prefill_attention_paged` (prefill_attention.h): a prefill chunk's causal
  attention over the pool in place (prefix and chunk; float32, bf16 or FP8 pool), flash-style
  tiles, GQA-grouped, parallel over (KV head, query block); models/llama.py takes it for every
  chunk of two or more tokens. bf16 queries over a bf16 pool (a bf16 model) take bf16_attn.h's
  order in both attention kernels where the CPU has vdpbf16ps (bf16 pair dots, bf16 weights);
- `pdcore_native::rope_store`: rotary over q and k with the K/V pool store, in one pass (equal
  to the bit to the aten operators); `silu_mul`: silu(gate) * up in one pass (float32: equal to
  the bit to aten's two operators); `add_rms_norm`: the residual add and the next RMSNorm in
  one pass over each row (float32, equal to the bit to aten's add_ and rms_norm);
- `pdcore_native::sample_rows`: a batch's token sampling, one row per task (sampler.h; the
  torch path of engine/sched/sampler.py where the library is not built);
- `pdcore_native::int8_linear` / `int8_pack` / `int8_gemm`: the W8A8 int8 GEMM (int8_gemm.h:
  AMX-INT8, AVX-512 VNNI or AVX2, `int8_path()`), equal to the bit to engine/model/quant.py's
  torch path;
  `add_rms_norm_quant` / `silu_mul_quant` (int8_act.h): the decode loop's int8 GEMM inputs
  quantized in the pass that makes them (x_q and s_x equal to the separate operators');
- `pdcore_native::decode_layers`: a Llama-family decode step's layer loop, the same operators
  in the same order as the Python loop in models/llama.py (equal to the bit); what it saves is
  the interpreter between ~25 small operators a layer; a W8A8 step (int8 panels, the float32
  view appended to) runs as one OpenMP parallel region (team_step.h: each phase shared out
  between the threads, a barrier after it; the same bits; `team_steps` counts them). With
  int8_fused = 3 (opt-in) a float32 step (float32 panels; the view appended to, or the pool
  read in place) runs as one region too, its work handed out by phase (team_f32.h,
  team_phase.h: an atomic item counter a phase, no barrier; the same bits).

One library per ISA, from the same source: `avx512` (AVX-512 F/BW/VL/DQ, 16 float lanes in one
register; the bf16 GEMM besides, for CPUs with AVX-512 BF16) and `avx2` (AVX2 + FMA, the 16
lanes as two registers: AMD Zen 2 and older Intel). The best this CPU has is loaded;
PDCORE_NATIVE_ISA=avx2|avx512 forces one (an ISA the CPU lacks is refused: the engine runs
without native kernels and says so), `off` none (as PDCORE_NATIVE=0). Both compute the same bits
(vec.h); `status()` and /metrics (`native_isa_*`) say which runs, the log says it once.

Built with the host's C++ compiler (g++ with OpenMP; no ninja, no Python headers: the library
registers torch operators and nothing else) into ~/.cache/pdserve/native (PDSERVE_NATIVE_DIR),
keyed by the sources, the torch version and the flags (the ISA and the ABI among them), in ~15 s
(minutes on a busy machine) once per machine and ISA: one process builds under a file lock
(`<library>.lock`), the others log that they wait and load its library. Where it
cannot be built (no compiler), the CPU has not even AVX2, or with PDCORE_NATIVE=0, the engine
runs as before and `status()` says why (logged once; the engine's stats carry it to /metrics).
The CPU's flags are cpu_features.cpu_flags(): PDCORE_CPU_ISA=avx2 (runtime_env) hides AVX-512 from
the choice too, PDCORE_CPUINFO describes another CPU.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import torch

from pdcore.engine.cpu_features import NATIVE_ISA_ENV, NATIVE_ISAS
from pdcore.env import ENV, Env

log = logging.getLogger(__name__)

NATIVE_ENV = Env.pdcore_native.name
ISA_ENV = NATIVE_ISA_ENV  # values checked at server start: cpu_features.native_isa_setting
# best first: the compiler flags of each ISA's library, and the CPU flags it needs
ISAS = {
    "avx512": (["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma",
                "-DPD_ISA_AVX512"], ("avx512f", "avx512bw", "avx512vl", "avx512dq", "fma")),
    "avx2": (["-mavx2", "-mfma", "-DPD_ISA_AVX2"], ("avx2", "fma")),
}
assert tuple(ISAS) == NATIVE_ISAS, "cpu_features.NATIVE_ISAS names these libraries"
DIR_ENV = Env.pdserve_native_dir.name
SOURCE = Path(__file__).with_name("decode_step.cpp")  # includes the headers beside it
BUILD_TIMEOUT_S = 300

_lock = threading.Lock()
# "ops": the operator namespace or None, "why": the reason it is None, "panel" / "bf16": whether
# the float32 / bf16 panel GEMMs serve (each resolved on first use)
_state: dict[str, object] = {}


def _cache_dir() -> Path:
    raw = ENV.pdserve_native_dir
    return Path(raw) if raw else Path.home() / ".cache" / "pdserve" / "native"


def _command(out: Path, isa: str = "avx512") -> list[str]:
    # torch's headers and libraries from its own folder (torch.utils.cpp_extension would say
    # the same, but imports setuptools, which a fresh virtual environment may lack)
    root = Path(torch.__file__).parent
    inc, lib = root / "include", root / "lib"
    cxx = ENV.cxx or "g++"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    # -fopenmp: at::parallel_for is inline OpenMP; the library binds to the libgomp torch has
    # already loaded (same soname), so there is one thread pool. -ffp-contract=off: a * b + c
    # rounds twice, as aten's elementwise operators do (the fused rotary is equal to the bit;
    # explicit FMA intrinsics stay FMAs)
    return [cxx, "-O3", "-shared", "-fPIC", "-std=c++17", "-w", "-fopenmp", "-ffp-contract=off",
            *ISAS[isa][0], f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-I{inc}",
            f"-I{inc / 'torch/csrc/api/include'}", str(SOURCE), f"-L{lib}", "-lc10", "-ltorch_cpu", "-o", str(out)]


def _build(isa: str) -> Path:
    """`isa`'s compiled library, built now if this source and torch have none yet."""
    cmd = _command(Path("out.so"), isa)
    # the key: the source, torch's version and the flags (not where torch is installed: each
    # CI run's fresh virtual environment would add a copy)
    flags = [a for a in cmd[:-1] if not a.startswith(("-I", "-L", "/"))]
    sources = b"".join(f.read_bytes() for f in [SOURCE, *sorted(SOURCE.parent.glob("*.h"))])
    key = hashlib.sha256(sources + torch.__version__.encode()
                         + " ".join(flags).encode()).hexdigest()[:16]
    target = _cache_dir() / f"decode_step-{isa}-{key}.so"
    if target.exists():
        return target
    if shutil.which(cmd[0]) is None:
        raise RuntimeError(f"no C++ compiler ({cmd[0]!r} is not on PATH; apt-get install g++)")
    target.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(target):
        if target.exists():  # built by the process that held the lock before us
            log.info("native kernels for %s: built by another process meanwhile", isa)
            return target
        _sweep(target.parent)
        fd, tmp = tempfile.mkstemp(prefix="building-", suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            cmd[-1] = tmp
            log.info("building the native kernels for %s (once per machine, 15 s to a few "
                        "minutes on a busy machine): %s", isa, target)
            t0 = time.monotonic()
            code, err = _compile(cmd)
            if code != 0:
                raise RuntimeError(f"{cmd[0]} failed (exit {code}): {err.strip()[-800:]}")
            os.replace(tmp, target)  # atomic: a reader never sees half a library
            log.info("native kernels for %s built in %.0f s", isa, time.monotonic() - t0)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return target


def _compile(cmd: list[str]) -> tuple[int, str]:
    """Run the compiler in a process group of its own: g++ runs cc1plus as a child, and a
    timeout that killed only g++ left cc1plus compiling on, orphaned, for minutes."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _, err = proc.communicate(timeout=BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        raise RuntimeError(f"{cmd[0]} did not finish in {BUILD_TIMEOUT_S:.0f} s (the machine "
                           "is busy, or the compiler is stuck): the native kernels were not "
                           "built") from None
    except BaseException:  # Ctrl-C: no compiler outlives the build either
        _kill_group(proc)
        raise
    return proc.returncode, err


def _kill_group(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()


@contextlib.contextmanager
def _build_lock(target: Path):
    """One builder per library on this machine: an exclusive flock on `<target>.lock`. A
    process that finds it held logs that it waits, then waits (at most the build timeout plus a
    minute; then it builds anyway, as before the lock). The kernel drops the lock of a builder
    that dies, so nobody waits on a dead one."""
    lock_path = target.with_name(target.name + ".lock")
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.warning("waiting for another process that is building the native kernels "
                        "(%s; pid %s)", target.name, _holder(fd) or "?")
            deadline = time.monotonic() + BUILD_TIMEOUT_S + 60
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        log.warning("gave up waiting for the other builder; building too")
                        os.close(fd)
                        fd = -1
                        break
                    time.sleep(0.2)
        if fd >= 0:
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        if fd >= 0:
            os.close(fd)  # releases the flock


def _holder(fd: int) -> str:
    """The pid the current lock holder wrote into the lock file ('' if none yet)."""
    try:
        return os.pread(fd, 32, 0).decode(errors="replace").strip()
    except OSError:
        return ""


def _cpu_has(isa: str) -> bool:
    """Whether the CPU has `isa`'s flags (as cpu_features sees them: PDCORE_CPU_ISA,
    PDCORE_CPUINFO)."""
    from pdcore.engine.cpu_features import cpu_flags

    return set(ISAS[isa][1]) <= cpu_flags()


def choose_isa() -> tuple[str | None, str]:
    """(the ISA whose library to load, '') or (None, why none)."""
    # read as text: a bad value is this status here (the server's start refuses it first,
    # cpu_features.native_isa_setting)
    raw = (Env.pdcore_native_isa.raw() or "").strip().lower()
    if raw == "off" or not ENV.pdcore_native:
        return None, f"{ISA_ENV}=off" if raw == "off" else f"{NATIVE_ENV}=0"
    if raw not in ("", "auto") and raw not in ISAS:
        return None, f"{ISA_ENV}={raw!r}: use auto, {', '.join(ISAS)} or off"
    if raw in ISAS:
        if not _cpu_has(raw):
            return None, f"{ISA_ENV}={raw}: this CPU lacks {raw} ({'/'.join(ISAS[raw][1])})"
        return raw, ""
    for isa in ISAS:
        if _cpu_has(isa):
            return isa, ""
    return None, "the CPU has neither AVX-512 nor AVX2 with FMA"


def ops():
    """The torch.ops.pdcore_native namespace of the chosen ISA's library, built and loaded on
    first call; None where it cannot be (then `status()` says why)."""
    with _lock:
        if "ops" not in _state:
            _state["ops"], _state["why"] = None, ""
            isa, why = choose_isa()
            _state["isa"], _state["why"] = isa, why
            if isa is None:
                log.warning("native kernels off, the Python decode loop and oneDNN GEMMs run: %s",
                            why)
            else:
                try:
                    torch.ops.load_library(str(_build(isa)))
                    _state["ops"] = torch.ops.pdcore_native
                    log.info("native kernels: %s", isa)
                except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                    _state["isa"], _state["why"] = None, str(e)
                    log.warning("native kernels unavailable, the Python decode loop and oneDNN "
                                "GEMMs run: %s", e)
        return _state["ops"]


def isa() -> str | None:
    """The ISA of the loaded library ('avx512', 'avx2'); None where none serves or before the
    first use (builds nothing)."""
    return _state.get("isa") if _state.get("ops") is not None else None


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
    """Whether float32 linear layers can take the panel GEMM (built: every ISA has it)."""
    if "panel" not in _state:
        o = ops()
        _state["panel"] = o is not None and bool(o.panel_gemm_supported())
    return bool(_state["panel"])


def bf16_gemm() -> bool:
    """Whether bf16 linear layers take the bf16 panel GEMM (built, and AVX-512 BF16)."""
    if "bf16" not in _state:
        o = ops()
        _state["bf16"] = o is not None and bool(o.bf16_gemm_supported())
    return bool(_state["bf16"])


INT8_PATHS = {3: "amx_int8", 2: "avx512_vnni", 1: "avx2", 0: "torch"}  # int8_path()'s values
INT8_CAPS = {"auto": 3, "amx": 3, "vnni": 2, "avx2": 1}  # PDCORE_W8A8_GEMM: the highest path


def int8_path() -> int:
    """The W8A8 int8 GEMM's path (int8_gemm.h), chosen once, set in the library (the decode
    loop's GEMMs and fused quantization take it too) and logged: 3, AMX-INT8 (the avx512
    library on a CPU with amx_int8, as cpu_features sees it: PDCORE_CPU_ISA=avx512 or avx2
    hides it, and Linux's tile permission); 2, AVX-512 VNNI (the avx512 library on a CPU with
    avx512_vnni); 1, AVX2 (either library: the avx2 one, or an AVX-512 CPU without VNNI); 0
    where no native library serves (engine/model/quant.py then runs torch._int_mm).
    PDCORE_W8A8_GEMM=vnni / avx2 caps it (A/B runs)."""
    with _lock:
        if "int8" in _state:
            return int(_state["int8"])
    o = ops()
    from pdcore.engine.cpu_features import cpu_flags

    flags, cap = cpu_flags(), INT8_CAPS[ENV.pdcore_w8a8_gemm]
    best = int(o.int8_best_path()) if o is not None else 0
    vnni = isa() == "avx512" and "avx512_vnni" in flags and best >= 2
    amx = vnni and "amx_int8" in flags
    capped = f"{Env.pdcore_w8a8_gemm.name}={ENV.pdcore_w8a8_gemm}"
    if o is None:
        path, why = 0, f"native kernels off: {_state.get('why')}"
    elif amx and cap >= 3 and best == 3:
        path, why = 3, "the avx512 library on a CPU with amx_int8"
    elif vnni and cap >= 2:
        path, why = 2, "the avx512 library on a CPU with avx512_vnni" + (
            "" if not amx else f"; no AMX: {capped}" if cap < 3 else
            f"; no AMX: {o.int8_amx_why()}")
    else:
        path, why = 1, (f"the {isa()} library" + ("" if isa() == "avx2" else
                                                    f", {capped}" if vnni else
                                                    " on a CPU without avx512_vnni"))
    with _lock:
        if "int8" not in _state:
            if o is not None:
                o.int8_set_path(path)
            _state["int8"] = path
            log.info("W8A8 int8 GEMM: %s (%s)", INT8_PATHS[path] if path else "torch._int_mm",
                     why)
        return int(_state["int8"])


GGUF_PATHS = {2: "avx512_vnni int8 dot", 1: "avx2 int8 dot", 3: "float activations",
              0: "the gguf package (no native kernels)"}  # gguf_path()'s values and names


def _gguf_vnni(o) -> bool:
    """Whether the library runs the VNNI GGUF path (whatever path is set now)."""
    try:
        return int(o.gguf_set_path(2)) == 2
    except RuntimeError:
        return False


def gguf_path() -> int:
    """The packed GGUF GEMM's path (gguf_gemm.h), chosen once, set in the library (the decode
    loop's GEMMs take it too) and logged: 3, float activations against de-quantized weights
    (PDCORE_GGUF_DOT=float); with PDCORE_GGUF_DOT=int8 (the default), 2, activations quantized
    per block of 32 and integer dot products with AVX-512 VNNI (the avx512 library on a CPU
    with avx512_vnni, as cpu_features sees it: PDCORE_CPU_ISA=avx2 hides it) or 1, the same
    integers with AVX2; 0 where no native library serves (gguf_packed.linear_fallback)."""
    with _lock:
        if "gguf" in _state:
            return int(_state["gguf"])
    o = ops()
    from pdcore.engine.cpu_features import cpu_flags

    if o is None:
        path, why = 0, f"native kernels off: {_state.get('why')}"
    elif ENV.pdcore_gguf_dot == "float":
        path, why = 3, "PDCORE_GGUF_DOT=float"
    elif isa() == "avx512" and "avx512_vnni" in cpu_flags() and _gguf_vnni(o):
        path, why = 2, "the avx512 library on a CPU with avx512_vnni"
    else:
        path, why = 1, (f"the {isa()} library" + ("" if isa() == "avx2" else
                                                    " on a CPU without avx512_vnni"))
    with _lock:
        if "gguf" not in _state:
            if o is not None:
                o.gguf_set_path(path)
            _state["gguf"] = path
            log.info("packed GGUF GEMM: %s (%s)", GGUF_PATHS[path], why)
        return int(_state["gguf"])


def status() -> str:
    """'native (<isa>)', or why the engine runs without it ('' before the first use)."""
    if "ops" not in _state:
        return ""
    if _state["ops"] is None:
        return f"off ({_state['why']})"
    return f"native ({_state['isa']})"
