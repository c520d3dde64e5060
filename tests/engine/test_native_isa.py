"""The native kernels' ISAs (pdcore/engine/native: one library per ISA, PDCORE_NATIVE_ISA):
test_native.py on every ISA this CPU has, the libraries computing the same bits, the choice
(forced off, unknown, an ISA the CPU lacks) reported, and an emulated AMD Zen 2 (qemu-x86_64
-cpu EPYC-Rome: its CPUID has AVX2 and FMA but no AVX-512, and QEMU executes no AVX-512
instruction) choosing the avx2 library by itself and computing what it computes here."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdcore.engine import native

NATIVE_TESTS = Path(__file__).with_name("test_native.py")
ATTENTION_TESTS = Path(__file__).with_name("test_native_attention.py")  # split from it
PANEL_TESTS = Path(__file__).with_name("test_native_panels.py")  # split from it too
BF16_ATTN_TESTS = Path(__file__).with_name("test_native_bf16_attention.py")  # #47's bf16 order
FP8_ATTN_TESTS = Path(__file__).with_name("test_native_fp8_attention.py")  # FP8 pools in place
SAMPLER_TESTS = Path(__file__).with_name("test_sampler_native.py")
INT8_TESTS = Path(__file__).with_name("test_native_int8.py")  # the W8A8 int8 GEMM's paths
# the default model's logprobs bit-equal at 1 and 2 threads (the team may resize mid-request)
THREAD_TESTS = Path(__file__).with_name("test_thread_invariance.py")
# a lone decode through the native loop equal to the old per-sequence path (#48)
LONE_TESTS = Path(__file__).with_name("test_lone_decode.py")
# /proc/cpuinfo's flags line of an AMD Zen 2 (AVX2 and FMA, no AVX-512)
ZEN2_FLAGS = "flags\t\t: fpu sse sse2 ssse3 sse4_1 sse4_2 avx f16c fma avx2 bmi2\n"

CHILD = r"""
import json, torch
from pdcore.engine import native
from pdcore.engine.model import layers
w = torch.nn.Parameter(torch.randn(40, 16), requires_grad=False)
keep, packed = layers.pack_in_place(w)
x = torch.randn(3, 16)
ok = torch.allclose(layers.linear(x, keep, None, packed), torch.nn.functional.linear(x, w),
                    atol=1e-5)
print(json.dumps({"status": native.status(), "ops": native.ops() is not None, "ok": ok,
                  "int8": native.int8_path(),
                  "int8_default": int(native.ops().int8_set_path(0)) if native.ops() else 0}))
"""


def _child(**env: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD], env={**os.environ, **env},
                         capture_output=True, text=True, timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("isa", list(native.ISAS))
def test_the_native_tests_on_every_isa(isa: str) -> None:
    """Each ISA's library passes test_native.py and test_sampler_native.py: the ISA a plain run
    loads there, every other one the CPU has in a child with PDCORE_NATIVE_ISA set."""
    if not native._cpu_has(isa):
        pytest.skip(f"this CPU lacks {isa} ({'/'.join(native.ISAS[isa][1])})")
    if native.choose_isa()[0] == isa:
        pytest.skip(f"{isa} is what test_native.py loads in a plain run")
    env = {**os.environ, native.ISA_ENV: isa}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "-p", "no:xdist", str(NATIVE_TESTS), str(ATTENTION_TESTS), str(PANEL_TESTS),
                        str(BF16_ATTN_TESTS), str(FP8_ATTN_TESTS), str(SAMPLER_TESTS),
                        str(INT8_TESTS), str(THREAD_TESTS), str(LONE_TESTS)],
                       env=env, capture_output=True, text=True,
                       timeout=900, check=False, cwd=NATIVE_TESTS.parent)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


def test_isa_forced_off_or_unknown_runs_without_native() -> None:
    r = _child(PDCORE_NATIVE="1", PDCORE_NATIVE_ISA="off")
    assert r["status"] == "off (PDCORE_NATIVE_ISA=off)" and not r["ops"] and r["ok"], r
    assert r["int8"] == 0, r  # W8A8 runs torch._int_mm
    r = _child(PDCORE_NATIVE="1", PDCORE_NATIVE_ISA="sse9")
    assert r["status"].startswith("off (PDCORE_NATIVE_ISA='sse9': use auto, avx512, avx2"), r
    assert r["ok"] and not r["ops"], r


def test_an_avx2_cpu_loads_the_avx2_library(tmp_path) -> None:
    """A CPU with AVX2 and FMA but no AVX-512 (AMD Zen 2) runs the avx2 library by default and
    refuses a forced avx512 (PDCORE_CPUINFO describes that CPU; the kernels run on this one)."""
    if not native._cpu_has("avx2"):
        pytest.skip("this CPU lacks avx2")
    info = tmp_path / "cpuinfo"
    info.write_text(ZEN2_FLAGS)
    r = _child(PDCORE_NATIVE="1", PDCORE_NATIVE_ISA="", PDCORE_CPUINFO=str(info))
    assert r["status"] == "native (avx2)" and r["ops"] and r["ok"] and r["int8"] == 1, r
    r = _child(PDCORE_NATIVE="1", PDCORE_NATIVE_ISA="avx512", PDCORE_CPUINFO=str(info))
    assert r["status"].startswith("off (PDCORE_NATIVE_ISA=avx512: this CPU lacks avx512"), r
    assert r["ok"] and not r["ops"], r


# an AMD Zen 4's flags: AVX-512 with VNNI, no AMX
ZEN4_FLAGS = ("flags\t\t: fpu sse sse2 ssse3 sse4_1 sse4_2 avx f16c fma avx2 bmi2 avx512f "
              "avx512dq avx512cd avx512bw avx512vl avx512_vnni avx512_bf16\n")


def test_amx_where_the_cpu_has_it_and_vnni_or_avx2_where_forced_down(tmp_path) -> None:
    """#48: on a CPU with amx_int8 the W8A8 int8 GEMM runs AMX (path 3); PDCORE_CPU_ISA=avx512
    (cpu_features drops the amx flags) runs VNNI in the avx512 library, PDCORE_CPU_ISA=avx2 the
    avx2 library's AVX2 path, a Zen 4 (AVX-512 VNNI, no AMX: PDCORE_CPUINFO) VNNI, and
    PDCORE_W8A8_GEMM=vnni / avx2 caps the path; the library's own default (what the decode
    loop's GEMMs take) follows the choice each time."""
    from pdcore.engine.cpu_features import cpu_flags

    if "amx_int8" not in cpu_flags() or not native._cpu_has("avx512"):
        pytest.skip("this CPU lacks amx_int8 (or the avx512 library): no AMX path to choose")
    base = {"PDCORE_NATIVE": "1", "PDCORE_NATIVE_ISA": "", "PDCORE_CPU_ISA": "",
            "PDCORE_W8A8_GEMM": "auto"}
    r = _child(**base)
    assert r["status"] == "native (avx512)" and r["int8"] == 3 == r["int8_default"], r
    r = _child(**{**base, "PDCORE_CPU_ISA": "avx512"})
    assert r["status"] == "native (avx512)" and r["int8"] == 2 == r["int8_default"], r
    r = _child(**{**base, "PDCORE_CPU_ISA": "avx2"})
    assert r["status"] == "native (avx2)" and r["int8"] == 1 == r["int8_default"], r
    info = tmp_path / "cpuinfo"
    info.write_text(ZEN4_FLAGS)
    r = _child(**{**base, "PDCORE_CPUINFO": str(info)})
    assert r["status"] == "native (avx512)" and r["int8"] == 2 == r["int8_default"], r
    for cap, want in (("vnni", 2), ("avx2", 1), ("amx", 3)):
        r = _child(**{**base, "PDCORE_W8A8_GEMM": cap})
        assert r["int8"] == want == r["int8_default"], (cap, r)


# an Intel Skylake-SP's flags: AVX-512 F/BW/VL/DQ, no AVX-512 VNNI
SKX_FLAGS = ("flags\t\t: fpu sse sse2 ssse3 sse4_1 sse4_2 avx f16c fma avx2 bmi2 avx512f "
             "avx512dq avx512cd avx512bw avx512vl\n")


def test_an_avx512_cpu_without_vnni_runs_the_avx2_int8_path(tmp_path) -> None:
    """The W8A8 int8 GEMM's VNNI path needs avx512_vnni besides the avx512 library: a CPU
    without it (Skylake-SP, described by PDCORE_CPUINFO) runs the AVX2 int8 path in the avx512
    library; with it (this CPU, where it has it) VNNI."""
    if not native._cpu_has("avx512"):
        pytest.skip("this CPU lacks avx512")
    info = tmp_path / "cpuinfo"
    info.write_text(SKX_FLAGS)
    r = _child(PDCORE_NATIVE="1", PDCORE_NATIVE_ISA="", PDCORE_CPUINFO=str(info))
    assert r["status"] == "native (avx512)" and r["ok"] and r["int8"] == 1, r


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
from pdcore.engine.model import gguf_packed as gp
blocks = torch.randint(0, 256, (100, 4, 34), generator=g, dtype=torch.uint8)
blocks[..., :2] = torch.tensor([0x66, 0x26], dtype=torch.uint8)  # f16 scale ~0.05: Q8_0
q8 = gp.typed(blocks.view(100, -1), 8)
nib = torch.randint(0, 256, (100, 4, 20), generator=g, dtype=torch.uint8)
nib[..., :4] = torch.tensor([0x66, 0x26, 0x66, 0xa6], dtype=torch.uint8)  # d, m: Q4_1
q41 = gp.typed(nib.view(100, -1), 3)
xg = torch.randn(13, 128, generator=g)
qi = torch.randint(-128, 128, (100, 68), dtype=torch.int8, generator=g)
torch.save({"linear": o.linear(x, layers.pack_panels(w), 100, b),
            "linear_bf16_weights": o.linear(x, layers.pack_panels(w.bfloat16()), 100, b),
            "int8_linear": o.int8_linear(torch.randn(13, 68, generator=g),
                                         o.int8_pack(qi, torch.rand(100, generator=g)), 100, b, 0),
            "gguf_q8_0": o.gguf_linear(xg, q8, 100, b), "gguf_q4_1": o.gguf_linear(xg[:5], q41, 100, None),
            "gguf_rows": o.gguf_rows(q41, torch.arange(100)),
            "gguf_x16_q8_0": o.gguf_linear(xg, o.gguf_repack(gp.typed(blocks.view(100, -1)[:96], 8)),
                                           96, b[:96]),
            "gguf_x16_q4_1": o.gguf_linear(xg[:5], o.gguf_repack(gp.typed(nib.view(100, -1)[:96], 3)),
                                           96, None),
            "attention": o.decode_attention(q, k, v, bias, 0.125),
            "silu_mul": o.silu_mul(torch.randn(67, 192, generator=g).bfloat16(), 96),
            "silu_mul_f32": o.silu_mul(torch.randn(67, 192, generator=g) * 4, 96),
            "add_rms_norm": o.add_rms_norm(torch.randn(37, 2048, generator=g),
                                           torch.randn(37, 2048, generator=g),
                                           torch.randn(2048, generator=g), 1e-5)},
           sys.argv[1])
"""


def test_every_isa_computes_the_same_bits(tmp_path) -> None:
    """vec.h's promise: the panel GEMM, decode attention, silu * up and the GGUF GEMMs of each
    ISA's library are equal to the bit (on these inputs) to the others'; the W8A8 int8 layer too
    (VNNI in the avx512 library where the CPU has it, AVX2 in the other)."""
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


EMULATED = "import torch; assert torch.backends.cpu.get_cpu_capability() == 'AVX2'\n"


def test_an_emulated_zen2_picks_avx2_and_computes_the_same_bits(tmp_path) -> None:
    """What a forced PDCORE_NATIVE_ISA=avx2 cannot show on this host: on a CPU whose CPUID
    lacks AVX-512 (torch and oneDNN dispatch by CPUID), nothing this process runs executes an
    AVX-512 instruction (QEMU has none: it would die of SIGILL) and the automatic choice is the
    avx2 library, equal to the bit to it run natively. /proc/cpuinfo under qemu-user is still
    this host's, so PDCORE_CPUINFO gives the emulated CPU's flags."""
    if platform.machine() != "x86_64" or shutil.which("qemu-x86_64") is None:
        pytest.skip("needs qemu-x86_64 on an x86_64 host (apt-get install qemu-user)")
    if not native._cpu_has("avx2"):
        pytest.skip("this CPU lacks avx2: nothing native to compare with")
    env = {**os.environ, "PDCORE_NATIVE": "1"}
    subprocess.run([sys.executable, "-c", SAME_BITS, str(tmp_path / "native"), "avx2"],
                   env={**env, native.ISA_ENV: "avx2"}, timeout=300, check=True)
    info = tmp_path / "cpuinfo"
    info.write_text(ZEN2_FLAGS)
    env = {k: v for k, v in env.items() if k not in (native.ISA_ENV, "PDCORE_CPU_ISA")}
    r = subprocess.run(["qemu-x86_64", "-cpu", "EPYC-Rome", sys.executable, "-c",
                        EMULATED + SAME_BITS, str(tmp_path / "zen2"), "avx2"],
                       env={**env, "PDCORE_CPUINFO": str(info)}, capture_output=True, text=True,
                       timeout=600, check=False)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    want, got = torch.load(tmp_path / "native"), torch.load(tmp_path / "zen2")
    for name in want:
        assert torch.equal(got[name], want[name]), name
