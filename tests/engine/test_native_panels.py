"""The float32 and bf16 panel GEMMs (engine/native: panel_gemm.h, gemm.h) against float64
references, a row's bits the same in any batch and across K blocks, and layers.linear routing
weights to them. Split from test_native.py (its helpers are shared); test_native_isa.py runs
this file on every ISA too."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdcore.engine import native
from pdcore.engine.cpu_features import LAYOUT_ENV, bf16_support
from pdcore.engine.model import layers
from test_native import _ops, _panels


@pytest.mark.parametrize("m", [1, 2, 7, 12, 13, 25, 200, 401])
@pytest.mark.parametrize("n,k", [(1, 1), (31, 15), (33, 64), (960, 576), (70, 577)])
def test_panel_linear_matches_float64(m: int, n: int, k: int) -> None:
    o = _panels()
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g)
    x = torch.randn(m, k, generator=g)
    ref = x.double() @ w.double().t()
    tol = 1e-5 * (1 + ref.abs().max().item()) * max(1, k / 64)
    panels = layers.pack_panels(w)
    assert panels.shape == (-(-n // 32), k, 32)
    got = o.linear(x, panels, n, None)
    assert got.shape == (m, n) and (got.double() - ref).abs().max().item() < tol
    got_b = o.linear(x, panels, n, b)
    assert (got_b.double() - (ref + b.double())).abs().max().item() < tol
    # leading dimensions are kept; a non-contiguous input is read correctly
    x3 = torch.randn(k, 2, m, generator=g).permute(1, 2, 0)
    y3 = o.linear(x3, panels, n, b)
    assert y3.shape == (2, m, n)
    torch.testing.assert_close(y3, F.linear(x3, w, b), rtol=1e-4, atol=tol)


@pytest.mark.parametrize("m", [13, 200, 401])
@pytest.mark.parametrize("n", [70, 100])
def test_panel_linear_rows_equal_one_row_gemms(m: int, n: int) -> None:
    """A GEMM of many rows (AVX-512: 6-row tiles down pairs of panels, an odd count's last
    panel alone; AVX2: x copied tile by tile into k-major order; rows in balanced blocks) gives
    each row the same bits as that row's GEMM alone (one panel at a time, x read as it is):
    every output sums over k in the same order, so a prompt's prefill and a decode step agree
    exactly."""
    o = _panels()
    g = torch.Generator().manual_seed(m + n)
    w = torch.randn(n, 1024, generator=g)  # K a multiple of 1024: x's rows alias in L1
    b = torch.randn(n, generator=g)
    x = torch.randn(m, 1024, generator=g)
    panels = layers.pack_panels(w)
    whole = o.linear(x, panels, n, b)
    rows = torch.cat([o.linear(x[i:i + 1], panels, n, b) for i in range(m)])
    assert torch.equal(whole, rows)


@pytest.mark.parametrize("m", [13, 97, 200])
@pytest.mark.parametrize("n,k", [(70, 1100), (100, 1024), (33, 2085)])
def test_panel_linear_k_blocks_equal_one_row_gemms(m: int, n: int, k: int) -> None:
    """A prefill's GEMM in blocks of K (AVX-512: each tile's partial sums left in y between
    blocks, the bias added after the last) gives every row the bits of that row's GEMM alone
    (decode's one tile, K whole), at the default blocking and at blocks that cross every edge:
    K not a multiple of the block (16 k, the smallest; 100, rounded up to 112), rows not a
    multiple of the 6-row tile nor of a block of rows (1 and 3 tiles a block), groups of 1, 2
    and all pairs, N not a multiple of 32 with an odd panel count (70, 33) or an even one
    (100); with and without bias, float32 and bf16 weights. The AVX2 library has no blocking
    knob: its default only."""
    o = _panels()
    g = torch.Generator().manual_seed(m * 7 + n + k)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g)
    x = torch.randn(m, k, generator=g)
    default = list(o.panel_tuning(0, 0, 0))
    tunings = ([default, [16, 1, 1], [100, 3, 2], [64, 16, 1000], [1 << 30, 16, 8]] if default
               else [[]])
    try:
        for weight in (w, w.bfloat16()):
            panels = layers.pack_panels(weight)
            for bias in (b, None):
                rows = torch.cat([o.linear(x[i:i + 1], panels, n, bias) for i in range(m)])
                for t in tunings:
                    if t:
                        assert list(o.panel_tuning(*t)) == t
                    assert torch.equal(o.linear(x, panels, n, bias), rows), (t, bias is None)
    finally:
        if default:
            o.panel_tuning(*default)


def test_linear_routes_float32_through_panels(monkeypatch: pytest.MonkeyPatch) -> None:
    _panels()
    monkeypatch.setenv(layers.PACKED_GEMM_ENV, "1")
    monkeypatch.setenv(LAYOUT_ENV, "panels")
    w = torch.nn.Parameter(torch.randn(100, 48), requires_grad=False)
    keep, packed = layers.pack_in_place(w)
    assert packed is not None and packed.layout == torch.strided and packed.dim() == 3
    assert keep.shape == w.shape and keep.untyped_storage().nbytes() <= 4  # one copy: a stand-in
    x = torch.randn(5, 48)
    torch.testing.assert_close(layers.linear(x, keep, None, packed), F.linear(x, w),
                               rtol=1e-5, atol=1e-5)
    # bf16: panels of k pairs where the CPU has AVX-512 BF16, else oneDNN's reordered weight
    if not bf16_support()[0]:
        return  # no bf16 model here (refused), nor oneDNN's bf16 reorder
    wb = torch.nn.Parameter(torch.randn(64, 32).to(torch.bfloat16), requires_grad=False)
    keep_b, pb = layers.pack_in_place(wb)
    assert pb is not None
    if native.bf16_gemm():
        assert pb.layout == torch.strided and pb.shape == (2, 16, 32, 2)
    else:
        assert pb.layout != torch.strided
    xb = torch.randn(3, 32).to(torch.bfloat16)
    torch.testing.assert_close(layers.linear(xb, keep_b, None, pb), F.linear(xb, wb),
                               rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("m", [1, 8, 13, 200])
@pytest.mark.parametrize("n,k", [(31, 15), (70, 577), (960, 576)])
def test_bf16_weight_panels_equal_the_widened_float_panels(m: int, n: int, k: int) -> None:
    """Panels of bf16 weights with float32 x (a W8A8 bf16 lm_head, loader.bf16_lm_head): each
    weight widened as it is read, so every tile path gives the float32 panels' bits on the
    widened matrix."""
    o = _panels()
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w, x, b = (torch.randn(n, k, generator=g).bfloat16(), torch.randn(m, k, generator=g),
               torch.randn(n, generator=g))
    for bias in (b, None):
        got = o.linear(x, layers.pack_panels(w), n, bias)
        assert got.dtype == torch.float32 and got.shape == (m, n)
        assert torch.equal(got, o.linear(x, layers.pack_panels(w.float()), n, bias))


@pytest.mark.parametrize("m", [1, 8, 13, 40])
@pytest.mark.parametrize("n,k", [(1, 2), (31, 16), (70, 578), (960, 576)])
def test_bf16_panel_linear_matches_float64(m: int, n: int, k: int) -> None:
    o = _ops()
    if not native.bf16_gemm():
        pytest.skip("the CPU lacks AVX-512 BF16")
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    ref = x.double() @ w.double().t() + b.double()  # exact products of the bf16 inputs
    got = o.linear_bf16(x, layers.pack_panels_bf16(w), n, b)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    # float32 accumulation, one rounding to bf16 (2^-8 relative) at the end
    err = (got.double() - ref).abs()
    assert (err <= ref.abs() * 2**-8 + 1e-4 * k**0.5).all(), err.max()
