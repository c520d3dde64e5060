"""What this CPU can compute in: bfloat16 needs AMX (amx_bf16) or AVX-512 BF16 (avx512_bf16).

Without either, torch still runs bfloat16 on CPU, but by converting every element to float32
and back in scalar code: several times slower than float32, so `--dtype bfloat16` is refused
there with a message instead of silently serving slower. The flags come from /proc/cpuinfo
(PDCORE_CPUINFO names another file: how tests describe a CPU this machine is not), less those
PDCORE_CPU_ISA forces away (runtime_env: `avx2` runs as an AVX2-only CPU would).
"""

from __future__ import annotations


from pdcore.env import ENV, Env
from pdcore.errors import ConfigError
from pdcore.runtime_env import forced_isa

CPUINFO_ENV = Env.pdcore_cpuinfo.name
LAYOUT_ENV = Env.pdcore_gemm_layout.name  # linear layers' weight layout (models/layers.py)
LAYOUTS = ("auto", "panels", "onednn")
NATIVE_ISA_ENV = Env.pdcore_native_isa.name
NATIVE_ISAS = ("avx512", "avx2")  # engine/native's libraries, best first
BF16_FLAGS = ("amx_bf16", "avx512_bf16")
# bench/bf16_cost.py with PDCORE_CPU_ISA=avx2 on a Xeon (SmolLM2's decode-step GEMMs, 8 rows):
# bfloat16 3.37x the float32 time (1 row: 1.10x); with AVX-512 BF16 / AMX it is 0.49x
EMULATED_BF16_COST = 3.4


def cpu_flags(path: str | None = None) -> set[str]:
    """This CPU's flags, less what PDCORE_CPU_ISA (runtime_env) forces away."""
    path = path or ENV.pdcore_cpuinfo or "/proc/cpuinfo"
    flags: set[str] = set()
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    try:
        isa = forced_isa()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    drop = {"avx2": ("avx512", "amx"), "avx512": ("amx",)}.get(isa, ())
    return {f for f in flags if not f.startswith(drop)} if drop else flags


def bf16_support() -> tuple[bool, str]:
    """(supported, what was found)."""
    flags = cpu_flags()
    found = [f for f in BF16_FLAGS if f in flags]
    if found:
        return True, f"this CPU has {' and '.join(found)}"
    return False, f"this CPU has neither {' nor '.join(BF16_FLAGS)}"


def check_cpu_dtype(dtype: str, device: str) -> None:
    """ConfigError for a compute dtype this CPU has no native support for (or a bad
    PDCORE_CPU_ISA)."""
    try:
        forced_isa()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if device != "cpu" or dtype not in ("bfloat16", "bf16"):
        return
    ok, why = bf16_support()
    if not ok:
        raise ConfigError(f"--dtype {dtype} on cpu needs AMX or AVX-512 BF16 and {why} "
                          "(bfloat16 would run emulated: a decode step's GEMMs at batch 8 took "
                          f"{EMULATED_BF16_COST}x as long as in float32, bench/bf16_cost.py); "
                          "use --dtype float32, and --kv-cache-dtype bfloat16 to halve the KV "
                          "pool")


def native_isa_setting() -> str:
    """PDCORE_NATIVE_ISA: auto (the best library the CPU runs), avx512, avx2 or off; a
    ConfigError (exit 2) for anything else, rather than a quiet run without the kernels.
    Forcing an ISA this CPU lacks is not an error here: engine/native says so in its status
    and the engine runs without it, as on a host without a compiler."""
    return ENV.pdcore_native_isa


def gemm_layout_setting() -> str:
    """PDCORE_GEMM_LAYOUT: auto (each weight shape timed in both layouts at load), panels (the
    native kernels' layout where they are built) or onednn; ConfigError for anything else."""
    return ENV.pdcore_gemm_layout
