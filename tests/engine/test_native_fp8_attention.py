"""FP8 K/V pools (--kv-cache-dtype fp8_e4m3 / fp8_e5m2) read in place by the paged decode kernel
(attention.h: attend_heads, fp8_load.h): each value widened as it is loaded and times the
layer's scale, float(x) * scale, the value the prefill kernel's pf_widen and a float32 decode
view hold. So the paged kernel over the FP8 pool equals, bit for bit, the view's kernel over
float32 copies of those values: every byte of both formats, whole and in parts, alone and in
padded groups, and a row's bits are the prefill kernel's. test_native_isa.py runs this file on
every ISA (the AVX2 widening too)."""

from __future__ import annotations

import pytest
import torch

from test_native import _panels
from test_native_attention import _pad_bias, _padded_group

FORMATS = [torch.float8_e4m3fn, torch.float8_e5m2]
SCALES = [(1.0, 1.0), (0.37, 1.9), (1.9, 0.37)]


def _wide(x: torch.Tensor, scale: float) -> torch.Tensor:
    """pf_widen's value of each element: float(x) * scale, in float32."""
    return x.float() * scale


def _pool(shape, dtype, g: torch.Generator) -> torch.Tensor:
    """Random FP8 values across the format's range (normals, subnormals, both signs)."""
    big = torch.finfo(dtype).max
    x = torch.randn(*shape, generator=g) * torch.exp2(torch.randint(-12, 6, shape, generator=g))
    return x.clamp(-big, big).to(dtype)


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Bit for bit, NaN at the same places (any NaN)."""
    nan = got.isnan()
    return bool(torch.equal(nan, want.isnan())
                and torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32)))


@pytest.mark.parametrize("dtype", FORMATS)
@pytest.mark.parametrize("ks,vs", SCALES)
def test_every_fp8_byte_widens_to_float_times_the_scale(dtype, ks, vs) -> None:
    """Each of the 256 byte values (zeros, subnormals, the largest, e4m3's NaN, e5m2's inf and
    NaN) as V of a one-key context (weight exactly 1, K zero): the paged kernel's output is
    the view kernel's over float(x) * scale, bit for bit."""
    o = _panels()
    kvh, d = 1, 64
    vp = torch.arange(256, dtype=torch.uint8).view(4, 1, kvh, d).view(dtype)  # 4 slots
    kp = torch.zeros(4, 1, kvh, d, dtype=torch.uint8).view(dtype)
    table = torch.arange(4)
    q = torch.randn(4, kvh, 1, d)
    got = o.decode_attention_paged(q, kp, vp, table, None, 0.125, ks, vs)
    kb = _wide(kp, ks).view(4, 1, kvh, d).transpose(1, 2)
    vb = _wide(vp, vs).view(4, 1, kvh, d).transpose(1, 2)
    want = o.decode_attention(q, kb, vb, None, 0.125)
    assert _same(got, want)
    assert got.isnan().any() and got.isfinite().sum() >= 240  # NaN (and e5m2's inf) kept apart


def _tables(lens, slots, g):
    table = torch.zeros(len(lens), max(lens), dtype=torch.long)
    for i, n in enumerate(lens):
        table[i, :n] = torch.randperm(slots, generator=g)[:n]
    return table.view(-1)


@pytest.mark.parametrize("dtype", FORMATS)
@pytest.mark.parametrize("ks,vs", SCALES)
@pytest.mark.parametrize("groups", [1, 3, 4])
def test_paged_decode_reads_an_fp8_pool_in_place(dtype, ks, vs, groups) -> None:
    """Scattered slots of an FP8 pool: one 3,000-key context (in parts, attention.h's
    da_split), one of 700, a padded group of three and one of two: the paged kernel equals,
    bit for bit, the view's kernel over float32 copies of the widened rows; a slot outside
    the pool is an error, not a read."""
    o = _panels()
    g = torch.Generator().manual_seed(groups + int(ks * 100))
    kvh, d, pages, page = 2, 64, 400, 8
    kp, vp = _pool((pages, page, kvh, d), dtype, g), _pool((pages, page, kvh, d), dtype, g)
    kf, vf = _wide(kp, ks).view(-1, kvh, d), _wide(vp, vs).view(-1, kvh, d)
    for lens in ([3000], [700], [3000, 17, 1500], [5, 9]):
        b, w = len(lens), max(lens)
        table = _tables(lens, pages * page, g)
        bias = None if b == 1 else _pad_bias(lens)
        q = torch.randn(b, kvh, groups, d, generator=g)
        kb = kf.index_select(0, table).view(b, w, kvh, d).transpose(1, 2)
        vb = vf.index_select(0, table).view(b, w, kvh, d).transpose(1, 2)
        got = o.decode_attention_paged(q, kp, vp, table, bias, d**-0.5, ks, vs)
        assert torch.equal(got, o.decode_attention(q, kb, vb, bias, d**-0.5)), lens
        assert not got.isnan().any(), lens
        if ks != 1.0:  # the scales are applied (unscaled values give other rows)
            unscaled = o.decode_attention_paged(q, kp, vp, table, bias, d**-0.5)
            assert not torch.equal(got, unscaled)
    q = torch.randn(1, kvh, groups, d, generator=g)
    table = torch.randperm(pages * page, generator=g)[:700]
    for bad in (pages * page, -1):
        table[5] = bad
        with pytest.raises(RuntimeError, match="outside the pool"):
            o.decode_attention_paged(q, kp, vp, table, None, 0.125, ks, vs)


@pytest.mark.parametrize("dtype", FORMATS)
def test_a_rows_bits_are_the_prefill_kernels_over_fp8(dtype) -> None:
    """The query at position p over a scaled FP8 pool: the causal prefill kernel's row equals
    the paged decode kernel's, alone (in parts at 1,100 keys) and in a padded group; the
    gathered path (a non-contiguous pool: the rows widened then attended) too."""
    o = _panels()
    g = torch.Generator().manual_seed(7)
    kvh, groups, d, ctx, page = 1, 8, 64, 1100, 16
    ks, vs, scale = 0.37, 1.9, d**-0.5
    pages = (2 * ctx + 100) // page
    kp, vp = _pool((pages, page, kvh, d), dtype, g), _pool((pages, page, kvh, d), dtype, g)
    perm = torch.randperm(pages * page, generator=g)
    slots, other = perm[:ctx], perm[ctx : 2 * ctx + 40]
    q = torch.randn(ctx, kvh * groups, d, generator=g)
    whole = o.prefill_attention_paged(q, kp, vp, slots, scale, ks, vs, kvh)
    for pos in (0, 63, 64, 700, ctx - 1):
        want = whole[pos].view(1, kvh, groups, d)
        qb = q[pos].reshape(1, kvh, groups, d)
        lone = o.decode_attention_paged(qb, kp, vp, slots[: pos + 1], None, scale, ks, vs)
        assert torch.equal(lone, want), ("lone decode", pos)
        table, bias = _padded_group(pos, slots, other)
        qg = torch.randn(3, kvh, groups, d, generator=g)
        qg[1] = qb[0]
        grp = o.decode_attention_paged(qg, kp, vp, table.view(-1), bias, scale, ks, vs)
        assert torch.equal(grp[1:2], want), ("decode group", pos)
    # a pool the kernel cannot read in place (every other slot row): gathered, widened alike
    kn = torch.stack([kp.view(-1, kvh, d), kp.view(-1, kvh, d)], 1)[:, 0]
    vn = torch.stack([vp.view(-1, kvh, d), vp.view(-1, kvh, d)], 1)[:, 0]
    assert not kn.is_contiguous()
    qb = q[ctx - 1].reshape(1, kvh, groups, d)
    got = o.decode_attention_paged(qb, kn, vn, slots, None, scale, ks, vs)
    assert torch.equal(got, whole[ctx - 1].view(1, kvh, groups, d))
