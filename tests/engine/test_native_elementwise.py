"""The float32 elementwise kernels that replace aten's operators in every forward (silu * up;
the residual add fused with the next RMSNorm): equal to aten's bits, checked in a child
process per aten capability (ATEN_CPU_CAPABILITY is read once, at torch's import); the W8A8
decode loop's add + norm quantized in the same pass (int8_act.h) equal to aten's norm then
quant.quantize_rows."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from test_native import _panels


ATEN_EQUAL = r"""
import sys, torch, torch.nn.functional as F
from pdcore.engine import native
from pdcore.engine.model.quant import quantize_rows
o = native.ops()
assert o is not None, native.status()
g = torch.Generator().manual_seed(3)
bad = []
for m, width in ((9, 32), (67, 96), (512, 1536), (3, 8192)):  # widths the kernel takes
    gu = torch.randn(m, 2 * width + 4, generator=g)[:, 4:] * 6  # strided rows, exp saturating
    got, want = o.silu_mul(gu, width), F.silu(gu[:, :width]) * gu[:, width:]
    bad += [] if torch.equal(got, want) else [("silu_mul", m, width)]
for t, h in ((1, 576), (512, 576), (37, 2048), (5, 4096), (3, 16384), (7, 80), (4, 24)):
    for scale in (1.0, 300.0):
        res, x = (torch.randn(t, h, generator=g) * scale for _ in range(2))
        w, eps = torch.randn(h, generator=g), 1e-5 if scale == 1.0 else 1e-6
        want_res = res + x
        want = F.rms_norm(want_res, (h,), w, eps)
        res0 = res.clone()
        got = o.add_rms_norm(res, x, w, eps)  # res in place
        bad += [] if torch.equal(res, want_res) and torch.equal(got, want) else [("add", t, h)]
        alone = o.add_rms_norm(want_res.clone(), torch.empty(0), w, eps)
        bad += [] if torch.equal(alone, want) else [("norm", t, h)]
        if h % 16 == 0:  # the W8A8 loop's fused pass (int8_act.h): aten's norm, quantized
            wq = quantize_rows(want)
            for path in range(1, int(o.int8_best_path()) + 1):
                r = res0.clone()
                q = o.add_rms_norm_quant(r, x, w, eps, path)
                ok = torch.equal(r, want_res) and all(map(torch.equal, q, wq))
                bad += [] if ok else [("norm_quant", t, h, path)]
assert not bad, bad
print(torch.backends.cpu.get_cpu_capability())
"""


@pytest.mark.parametrize("aten", ["", "avx2"])
def test_float32_silu_mul_and_add_rms_norm_equal_aten(aten: str) -> None:
    """The float32 silu * up and residual add + RMSNorm kernels compute aten's operators' bits
    (silu: its vector form and Sleef exp; the norm: its sum kernel's row order, 8 lanes under
    aten's AVX-512 capability as under ATEN_CPU_CAPABILITY=avx2), on widths they take (80:
    vectors left over from the four-way split; 16384: rows long enough for the summation's
    levels) and one they leave to aten (24: not a multiple of 16)."""
    _panels()
    env = {**os.environ, "ATEN_CPU_CAPABILITY": aten} if aten else dict(os.environ)
    r = subprocess.run([sys.executable, "-c", ATEN_EQUAL], env=env, timeout=300,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    if aten:
        assert r.stdout.strip() == "AVX2", r.stdout
