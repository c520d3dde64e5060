"""#48: the native W8A8 int8 GEMM (pdcore/engine/native/int8_gemm.h). Every path this library
runs (AMX-INT8 where the CPU has amx_int8, AVX-512 VNNI where it has avx512_vnni, AVX2 always)
computes the int32 sums equal to
torch._int_mm, and the whole layer (per-token quantization, GEMM, scales, bias) equal to the bit
to engine/model/quant.py's torch path, over shapes that reach every tile size, a K that is not a
multiple of 4, an N that is not a multiple of the 32-channel panel, and a prefill's blocks of
rows. The path the engine chose is the one the CPU's flags call for.

This process runs the best library this CPU has; test_native_isa.py runs the file again with
PDCORE_NATIVE_ISA=avx2 (the AVX2 library, built without AVX-512)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdcore.engine import native
from pdcore.engine.cpu_features import cpu_flags
from pdcore.engine.model.quant import Int8Weight, quantize_rows

# (M rows, N channels, K): 1..13 rows (each tile size, 13 = 7 + 6), a 200-row prefill (two
# blocks of tiles), K = 67 (padded to 68), N = 100 (a partial last panel), SmolLM2's shapes
SHAPES = [(1, 40, 16), (2, 32, 4), (3, 100, 67), (5, 65, 130), (8, 960, 576), (12, 33, 64),
          (13, 576, 576), (37, 576, 1536), (200, 130, 68), (0, 32, 8)]


def _paths() -> list[int]:
    o = native.ops()
    if o is None:
        pytest.skip(f"native kernels unavailable here: {native.status()}")
    return list(range(1, int(o.int8_best_path()) + 1))  # 3: AMX, 2: VNNI, 1: AVX2


def _reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
               b: torch.Tensor | None) -> torch.Tensor:
    """quant.Int8Weight's torch path, written out: quantize_rows, _int_mm, the scales, + b."""
    xq, xs = quantize_rows(x)
    y = torch._int_mm(xq, q.t()).float().mul_(xs).mul_(scale.reshape(-1))
    return y.add_(b) if b is not None else y


def test_int32_sums_equal_int_mm_on_every_path():
    paths = _paths()
    g = torch.Generator().manual_seed(0)
    o = torch.ops.pdcore_native
    for m, n, k in SHAPES:
        q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
        q[0, : min(k, 5)] = -128  # the extreme weight, against extreme activations below
        packed = o.int8_pack(q, torch.rand(n, generator=g))
        xq = torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=g)
        if m:
            xq[0] = -127
            xq[-1, : k // 2] = 127
        want = torch._int_mm(xq, q.t()) if m else torch.zeros(0, n, dtype=torch.int32)
        # the integer math itself, in int64 numpy, besides torch's int8 GEMM
        assert np.array_equal(want.numpy(), xq.numpy().astype(np.int64)
                              @ q.numpy().astype(np.int64).T), (m, n, k)
        for path in paths:
            got = o.int8_gemm(xq, packed, n, path)
            assert got.dtype == torch.int32 and torch.equal(got, want), (m, n, k, path)
    with pytest.raises(RuntimeError, match=r"\[-127, 127\]"):
        o.int8_gemm(torch.full((2, 8), -128, dtype=torch.int8), packed_of(8, 32), 32, 1)


def packed_of(k: int, n: int) -> torch.Tensor:
    return torch.ops.pdcore_native.int8_pack(torch.ones(n, k, dtype=torch.int8), torch.ones(n))


def test_the_layer_equals_the_torch_path_to_the_bit():
    paths = _paths()
    g = torch.Generator().manual_seed(1)
    o = torch.ops.pdcore_native
    for m, n, k in SHAPES:
        q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
        scale = torch.rand(n, 1, generator=g) / 50
        packed = o.int8_pack(q, scale)
        # rows of very different sizes, and a row of zeros (scale 1, all-zero x_q)
        x = torch.randn(m, k, generator=g) * torch.logspace(-3, 2, max(m, 1))[:m, None]
        if m > 2:
            x[2] = 0
        b = torch.randn(n, generator=g)
        for path in paths:
            for bias in (None, b):
                got = o.int8_linear(x, packed, n, bias, path)
                assert torch.equal(got, _reference(x, q, scale, bias)), (m, n, k, path, bias)
    # leading dimensions and bf16 inputs, as the model's layers pass them
    x = torch.randn(2, 3, 64, generator=g)
    q = torch.randint(-128, 128, (48, 64), dtype=torch.int8, generator=g)
    packed = o.int8_pack(q, torch.ones(48))
    for path in paths:
        assert torch.equal(o.int8_linear(x, packed, 48, None, path),
                           _reference(x.view(6, 64), q, torch.ones(48), None).view(2, 3, 48))
        y = o.int8_linear(x.bfloat16(), packed, 48, None, path)
        assert y.dtype == torch.bfloat16 and torch.equal(
            y, _reference(x.bfloat16().view(6, 64), q, torch.ones(48), None).bfloat16()
            .view(2, 3, 48))
    with pytest.raises(RuntimeError, match="do not match"):
        o.int8_linear(torch.randn(2, 60), packed, 48, None, 1)


def test_the_amx_path_sums_equal_int_mm_over_its_tails():
    """The AMX path (two 16-row A tiles and a panel's two B tiles per work item, 64 k a step)
    against torch._int_mm over M that end inside a tile (1, 3, 8, 15, 17, 100, 513: 513 = 16
    tiles of 32 and one row) or fill it (16), K that end inside a 64-k step (4, 60, 68: the
    zero-padded tail) or not (64, 576, 1536, 8192), and N with a partial last panel."""
    if 3 not in _paths():
        pytest.skip("no AMX path here: " + (torch.ops.pdcore_native.int8_amx_why() or
                                            "the library's best path is below 3"))
    g = torch.Generator().manual_seed(7)
    o = torch.ops.pdcore_native
    bad = []
    before = int(o.int8_amx_min_rows(0))  # 0: read; by default 1-3 rows run VNNI
    try:
        assert int(o.int8_amx_min_rows(1)) == 1  # the tiles at every M
        for k in (4, 60, 64, 68, 576, 1536, 8192):
            for n in (40, 96) if k < 8192 else (33,):
                q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
                q[0, : min(k, 5)] = -128
                packed = o.int8_pack(q, torch.rand(n, generator=g))
                for m in (1, 3, 8, 15, 16, 17, 100, 513):
                    xq = torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=g)
                    xq[0] = -127
                    xq[-1, : k // 2] = 127
                    if not torch.equal(o.int8_gemm(xq, packed, n, 3), torch._int_mm(xq, q.t())):
                        bad.append((m, k, n))
                x = torch.randn(5, k, generator=g)  # and the layer, 1-row and 5-row
                for rows in (x[:1], x):
                    if not torch.equal(o.int8_linear(rows, packed, n, None, 3),
                                       o.int8_linear(rows, packed, n, None, 1)):
                        bad.append(("linear", rows.shape[0], k, n))
    finally:
        o.int8_amx_min_rows(before)
    assert before == 4 and not bad, (before, bad)


def test_int8_weight_runs_the_chosen_path_and_keeps_one_copy(caplog):
    """Int8Weight (what the model's linear layers hold) packs its matrix once for the path the
    CPU's flags call for and keeps no second copy; the matrix comes back out of the panels.
    The path is logged once and set as the library's (the decode loop's path 0)."""
    import logging

    _paths()
    flags = cpu_flags()
    o = torch.ops.pdcore_native
    vnni = native.isa() == "avx512" and "avx512_vnni" in flags
    amx = vnni and "amx_int8" in flags and not o.int8_amx_why()
    want = 3 if amx else 2 if vnni else 1
    before = native._state.pop("int8", None)
    try:
        with caplog.at_level(logging.INFO, logger="pdcore.engine.native"):
            assert native.int8_path() == want, (
                native.status(), o.int8_amx_why(),
                sorted(f for f in flags if "vnni" in f or "amx" in f))
    finally:
        if before is not None:
            native._state["int8"] = before
    names = {3: "amx_int8", 2: "avx512_vnni", 1: "avx2"}
    assert f"W8A8 int8 GEMM: {names[want]} (" in caplog.text, caplog.text
    assert "no kernel" not in caplog.text
    if "amx_int8" in flags and native.isa() == "avx512" and not amx:
        assert "no AMX: " in caplog.text, caplog.text  # the reason is logged
    assert int(o.int8_set_path(0)) == want
    g = torch.Generator().manual_seed(2)
    q = torch.randint(-128, 128, (70, 90), dtype=torch.int8, generator=g)
    s = torch.rand(70, generator=g)
    w = Int8Weight(q, s)
    assert w.path == want and w.packed is not None and w.q.untyped_storage().nbytes() <= 1
    assert torch.equal(w.matrix(), q) and w.shape == (70, 90)
    x = torch.randn(9, 90, generator=g)
    assert torch.equal(w(x), _reference(x, q, s, None))


def test_fused_norm_and_silu_quantization_equal_the_separate_operators():
    """The W8A8 decode loop's fused passes (int8_act.h): the residual add + RMSNorm and silu * up
    each quantized per row in the pass that makes the row give the x_q and s_x that
    quant.quantize_rows gives for add_rms_norm's / silu_mul's output, on every path (the
    VNNI path's bytes carry x_q + 128), with the residual updated as add_rms_norm updates it;
    tensors the passes do not take are refused, not quantized some other way."""
    paths = _paths()
    g = torch.Generator().manual_seed(5)
    o = torch.ops.pdcore_native
    for t, h in ((1, 576), (8, 576), (13, 64), (5, 80), (3, 4096)):
        for scale in (1.0, 300.0):
            res = torch.randn(t, h, generator=g) * scale
            x = torch.randn(t, h, generator=g) * scale
            x[0, 3] = 40 * scale  # one large activation sets a row's scale (the lm_head case)
            w = torch.randn(h, generator=g)
            want_res = res.clone()
            want = quantize_rows(o.add_rms_norm(want_res, x, w, 1e-5))
            alone = quantize_rows(o.add_rms_norm(want_res.clone(), torch.empty(0), w, 1e-5))
            for path in paths:
                got_res = res.clone()
                got = o.add_rms_norm_quant(got_res, x, w, 1e-5, path)
                assert torch.equal(got_res, want_res), (t, h, path)
                assert all(torch.equal(a, b) for a, b in zip(got, want)), (t, h, scale, path)
                assert got[0].dtype == torch.int8 and got[0].shape == (t, h)
                before = want_res.clone()
                got = o.add_rms_norm_quant(want_res, torch.empty(0), w, 1e-5, path)
                assert torch.equal(want_res, before)  # no add: the residual is only read
                assert all(torch.equal(a, b) for a, b in zip(got, alone)), (t, h, path)
    for m, inter in ((1, 1536), (8, 1536), (9, 32), (3, 96)):
        gu = torch.randn(m, 2 * inter + 4, generator=g)[:, 4:] * 6  # strided rows, as sliced
        gu[:, 0] = 0.0
        want = quantize_rows(o.silu_mul(gu, inter))
        for path in paths:
            got = o.silu_mul_quant(gu, inter, path)
            assert all(torch.equal(a, b) for a, b in zip(got, want)), (m, inter, path)
    with pytest.raises(RuntimeError, match="does not apply"):
        o.add_rms_norm_quant(torch.randn(2, 24), torch.randn(2, 24), torch.ones(24), 1e-5, 0)
    with pytest.raises(RuntimeError, match="does not apply"):
        o.silu_mul_quant(torch.randn(2, 2 * 48), 48, 0)
    with pytest.raises(RuntimeError, match="does not apply"):
        o.add_rms_norm_quant(torch.randn(2, 64).bfloat16(), torch.empty(0), torch.ones(64), 1e-5, 0)
