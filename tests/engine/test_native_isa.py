"""The native kernels' ISAs (pdcore/engine/native: one library per ISA, PDCORE_NATIVE_ISA):
test_native.py on every ISA this CPU has, the libraries computing the same bits, and the choice
(forced off, unknown, an ISA the CPU lacks) reported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdcore.engine import native

NATIVE_TESTS = Path(__file__).with_name("test_native.py")

CHILD = r"""
import json, torch
from pdcore.engine import native
from pdcore.engine.model import layers
w = torch.nn.Parameter(torch.randn(40, 16), requires_grad=False)
keep, packed = layers.pack_in_place(w)
x = torch.randn(3, 16)
ok = torch.allclose(layers.linear(x, keep, None, packed), torch.nn.functional.linear(x, w),
                    atol=1e-5)
print(json.dumps({"status": native.status(), "ops": native.ops() is not None, "ok": ok}))
"""


def _child(**env: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD], env={**os.environ, **env},
                         capture_output=True, text=True, timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("isa", list(native.ISAS))
def test_the_native_tests_on_every_isa(isa: str) -> None:
    """Each ISA's library passes test_native.py: the ISA a plain run loads there, every other
    one the CPU has in a child with PDCORE_NATIVE_ISA set."""
    if not native._cpu_has(isa):
        pytest.skip(f"this CPU lacks {isa} ({'/'.join(native.ISAS[isa][1])})")
    if native.choose_isa()[0] == isa:
        pytest.skip(f"{isa} is what test_native.py loads in a plain run")
    env = {**os.environ, native.ISA_ENV: isa}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "-p", "no:xdist", str(NATIVE_TESTS)], env=env, capture_output=True, text=True,
                       timeout=900, check=False, cwd=NATIVE_TESTS.parent)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


def test_isa_forced_off_or_unknown_runs_without_native() -> None:
    r = _child(PDCORE_NATIVE="1", PDCORE_NATIVE_ISA="off")
    assert r["status"] == "off (PDCORE_NATIVE_ISA=off)" and not r["ops"] and r["ok"], r
    r = _child(PDCORE_NATIVE="1", PDCORE_NATIVE_ISA="sse9")
    assert r["status"].startswith("off (PDCORE_NATIVE_ISA='sse9': use auto, avx512, avx2"), r
    assert r["ok"] and not r["ops"], r


def test_an_avx2_cpu_loads_the_avx2_library(tmp_path) -> None:
    """A CPU with AVX2 and FMA but no AVX-512 (AMD Zen 2) runs the avx2 library by default and
    refuses a forced avx512 (PDCORE_CPUINFO describes that CPU; the kernels run on this one)."""
    if not native._cpu_has("avx2"):
        pytest.skip("this CPU lacks avx2")
    info = tmp_path / "cpuinfo"
    info.write_text("flags\t\t: fpu sse sse2 ssse3 sse4_1 sse4_2 avx f16c fma avx2 bmi2\n")
    r = _child(PDCORE_NATIVE="1", PDCORE_NATIVE_ISA="", PDCORE_CPUINFO=str(info))
    assert r["status"] == "native (avx2)" and r["ops"] and r["ok"], r
    r = _child(PDCORE_NATIVE="1", PDCORE_NATIVE_ISA="avx512", PDCORE_CPUINFO=str(info))
    assert r["status"].startswith("off (PDCORE_NATIVE_ISA=avx512: this CPU lacks avx512"), r
    assert r["ok"] and not r["ops"], r


SAME_BITS = r"""
import sys, torch
from pdcore.engine import native
from pdcore.engine.model import layers
o = native.ops()
assert native.isa() == sys.argv[2], native.status()
g = torch.Generator().manual_seed(0)
w, x, b = (torch.randn(100, 64, generator=g), torch.randn(13, 64, generator=g),
           torch.randn(100, generator=g))
q, k, v = (torch.randn(3, 2, 3, 64, generator=g), torch.randn(3, 2, 37, 64, generator=g),
           torch.randn(3, 2, 37, 64, generator=g))
bias = torch.zeros(3, 1, 1, 37)
bias[0, ..., 30:] = float("-inf")
torch.save({"linear": o.linear(x, layers.pack_panels(w), 100, b),
            "attention": o.decode_attention(q, k, v, bias, 0.125),
            "silu_mul": o.silu_mul(torch.randn(67, 192, generator=g).bfloat16(), 96)},
           sys.argv[1])
"""


def test_every_isa_computes_the_same_bits(tmp_path) -> None:
    """vec.h's promise: the panel GEMM, decode attention and silu * up of each ISA's library
    are equal to the bit (on these inputs) to the others'."""
    isas = [i for i in native.ISAS if native._cpu_has(i)]
    if len(isas) < 2:
        pytest.skip(f"this CPU has one ISA of {list(native.ISAS)}: {isas}")
    outs = []
    for isa in isas:
        env = {**os.environ, native.ISA_ENV: isa, "PDCORE_NATIVE": "1"}
        subprocess.run([sys.executable, "-c", SAME_BITS, str(tmp_path / isa), isa], env=env,
                       timeout=300, check=True)
        outs.append(torch.load(tmp_path / isa))
    for name, want in outs[0].items():
        for isa, out in zip(isas[1:], outs[1:]):
            assert torch.equal(out[name], want), (name, isa)
