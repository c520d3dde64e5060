"""PDCORE_CPU_ISA (pdcore/runtime_env.py): run as a CPU with less than this one has, so the paths
an AVX2-only host takes (AMD Zen 2: no AVX-512, no bf16 hardware) are tested and measured on an
AVX-512 one. torch's kernels, oneDNN's, and the bf16 decision all follow it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pdcore.engine import cpu_features
from pdcore.errors import ConfigError
from pdcore.runtime_env import ISA_ENV, forced_isa

XEON = "flags\t\t: fpu sse4_2 avx avx2 fma avx512f avx512bw avx512vl avx512_bf16 amx_bf16 amx_tile\n"


@pytest.fixture
def xeon(tmp_path, monkeypatch: pytest.MonkeyPatch):
    info = tmp_path / "cpuinfo"
    info.write_text(XEON)
    monkeypatch.setenv(cpu_features.CPUINFO_ENV, str(info))
    monkeypatch.delenv(ISA_ENV, raising=False)  # the suite may run forced down (CI's AVX2 run)
    return monkeypatch


def test_forced_isa_values() -> None:
    assert forced_isa({}) == "" and forced_isa({ISA_ENV: "auto"}) == ""
    assert forced_isa({ISA_ENV: "AVX2"}) == "avx2" and forced_isa({ISA_ENV: "avx512"}) == "avx512"
    with pytest.raises(ValueError, match="avx512 or avx2"):
        forced_isa({ISA_ENV: "sse"})


def test_avx2_hides_avx512_amx_and_bf16(xeon) -> None:
    assert cpu_features.bf16_support()[0]
    xeon.setenv(ISA_ENV, "avx2")
    flags = cpu_features.cpu_flags()
    assert "avx2" in flags and not any(f.startswith(("avx512", "amx")) for f in flags)
    ok, why = cpu_features.bf16_support()
    assert not ok and "neither" in why
    with pytest.raises(ConfigError, match="--dtype bfloat16 on cpu needs AMX or AVX-512 BF16"):
        cpu_features.check_cpu_dtype("bfloat16", "cpu")
    cpu_features.check_cpu_dtype("float32", "cpu")  # float32 is fine everywhere


def test_avx512_keeps_avx512_bf16_without_amx(xeon) -> None:
    xeon.setenv(ISA_ENV, "avx512")
    flags = cpu_features.cpu_flags()
    assert "avx512_bf16" in flags and not any(f.startswith("amx") for f in flags)
    assert cpu_features.bf16_support() == (True, "this CPU has avx512_bf16")


def test_a_bad_value_is_a_config_error(xeon) -> None:
    xeon.setenv(ISA_ENV, "avx1024")
    with pytest.raises(ConfigError, match=ISA_ENV):
        cpu_features.check_cpu_dtype("float32", "cpu")


@pytest.mark.skipif("avx2" not in cpu_features.cpu_flags(), reason="this CPU has no AVX2")
def test_torch_and_onednn_follow_it() -> None:
    """In a fresh process (torch reads its capability once, at import): apply() caps torch's
    kernels and oneDNN's at AVX2."""
    code = ("from pdcore.runtime_env import apply; apply(); import os, torch; "
            "print(torch.backends.cpu.get_cpu_capability(), os.environ['ONEDNN_MAX_CPU_ISA'])")
    env = {k: v for k, v in os.environ.items()
           if k not in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")}
    out = subprocess.run([sys.executable, "-c", code], env={**env, ISA_ENV: "avx2"},
                         capture_output=True, text=True, timeout=120, check=True).stdout.split()
    assert out == ["AVX2", "AVX2"], out


def test_a_bad_native_isa_stops_the_server_with_exit_2(tmp_path) -> None:
    """PDCORE_NATIVE_ISA=avx1024 once ran quietly without the native kernels; now the server
    refuses to start and says what to use (values that exist: tests/engine/test_native_isa.py)."""
    for good in ("", "auto", "OFF", "avx2", "avx512"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(cpu_features.NATIVE_ISA_ENV, good)
            assert cpu_features.native_isa_setting() == (good.lower() or "auto")
    env = {**os.environ, cpu_features.NATIVE_ISA_ENV: "avx1024"}
    run = subprocess.run([sys.executable, "-m", "pdcore.launch_server", "--model-path",
                          str(tmp_path)], env=env, capture_output=True, text=True, timeout=120,
                         check=False)
    assert run.returncode == 2, run.stderr[-2000:]
    assert "PDCORE_NATIVE_ISA must be one of auto, avx512, avx2 or off; got 'avx1024'" in \
        run.stderr, run.stderr[-2000:]
