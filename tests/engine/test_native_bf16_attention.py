"""bf16 attention (#47, native/bf16_attn.h): a bf16 model's queries over a bf16 pool take one
bf16 order in every path where the CPU has vdpbf16ps (q . k and P V as bf16 pair dots, the
block's weights rounded to bf16), else the widening order of a float32 pool. Either way a row
has the same bits in the prefill kernel (whole or a chunk after a prefix), the paged decode
kernel alone (in parts at a long context), and in a padded decode group; and the rows stay
close to float64 attention (rel 1e-2 of the output's scale: the weights keep 8 bits)."""

from __future__ import annotations

import pytest
import torch

from pdcore.engine import native
from test_native import _panels
from test_native_attention import _causal_reference, _pad_bias, _padded_group


def _dot_order() -> bool:
    """Whether this library takes the bf16 order (vdpbf16ps) for bf16 queries and pools."""
    return native.bf16_gemm()


def _pools(g, pages, page, kvh, d):  # type: ignore
    kp = torch.randn(pages, page, kvh, d, generator=g).bfloat16()
    vp = torch.randn(pages, page, kvh, d, generator=g).bfloat16()
    return kp, vp


@pytest.mark.parametrize("kvh,groups,d,ctx", [(3, 3, 64, 401), (2, 4, 128, 333),
                                              (2, 1, 64, 1100), (1, 4, 32, 130),
                                              (1, 3, 128, 77)])
def test_bf16_rows_have_the_same_bits_in_every_phase(kvh, groups, d, ctx) -> None:
    """The query at position p (bf16, strided as the qkv pack hands it over) gets the same
    float32 bits from the causal prefill kernel (whole prompt; a chunk after a prefix of 1, 64
    or half the prompt), the paged decode kernel alone (past two parts at 1100: in parts) and
    in a padded decode group between a longer and a shorter context; GQA 1, 3 and 4, head_dim
    32, 64 and 128, odd lengths."""
    o = _panels()
    g = torch.Generator().manual_seed(ctx + d + groups)
    h, page = kvh * groups, 16
    pages = (2 * ctx + 100) // page
    kp, vp = _pools(g, pages, page, kvh, d)
    perm = torch.randperm(pages * page, generator=g)
    slots, other = perm[:ctx], perm[ctx : 2 * ctx + 40]
    q = torch.randn(ctx, h + 2 * kvh, d, generator=g).bfloat16()[:, :h]
    scale = d**-0.5

    def prefill(qs: torch.Tensor) -> torch.Tensor:  # float32 rows (`out` float32: unrounded)
        out = torch.empty(qs.shape)
        got = o.prefill_attention_paged(qs, kp, vp, slots, scale, 1.0, 1.0, kvh, out)
        assert got.data_ptr() == out.data_ptr()
        return out

    whole = prefill(q)
    rounded = o.prefill_attention_paged(q, kp, vp, slots, scale, 1.0, 1.0, kvh)
    assert rounded.dtype == torch.bfloat16 and torch.equal(rounded, whole.bfloat16())
    for cut in (1, 64, ctx // 2 + 5):
        assert torch.equal(prefill(q[cut:]), whole[cut:]), cut
    for pos in sorted({0, 1, 15, 63, 64, 65, 200, ctx - 2, ctx - 1}):
        if pos >= ctx:
            continue
        want = whole[pos].view(1, kvh, groups, d)
        qb = q[pos].reshape(1, kvh, groups, d)
        lone = o.decode_attention_paged(qb, kp, vp, slots[: pos + 1], None, scale)
        assert lone.dtype == torch.float32 and torch.equal(lone, want), ("lone", pos)
        table, bias = _padded_group(pos, slots, other)
        qg = torch.randn(3, kvh, groups, d, generator=g).bfloat16()
        qg[1] = qb[0]
        grp = o.decode_attention_paged(qg, kp, vp, table.view(-1), bias, scale)
        assert torch.equal(grp[1:2], want), ("group", pos)


@pytest.mark.parametrize("kvh,groups,d", [(3, 3, 64), (2, 4, 128), (2, 1, 32)])
def test_bf16_attention_is_close_and_takes_the_dot_order_where_it_can(kvh, groups, d) -> None:
    """bf16 queries over a bf16 pool: prefill and decode rows within rel 1e-2 of float64
    attention over the same values. Where the CPU has vdpbf16ps they differ from the widening
    order (float32 queries of the same values: a float32 model's path over a bf16 pool), where
    it does not they equal it to the bit; head_dim 48 (not pairs of 16-pair loads) widens."""
    o = _panels()
    g = torch.Generator().manual_seed(kvh * groups * d)
    h, page, ctx, n = kvh * groups, 16, 300, 120
    kp, vp = _pools(g, ctx // page + 8, page, kvh, d)
    slots = torch.randperm(kp.shape[0] * page, generator=g)[:ctx]
    q = torch.randn(n, h, d, generator=g).bfloat16()
    scale = d**-0.5
    out, wide = torch.empty(n, h, d), torch.empty(n, h, d)
    o.prefill_attention_paged(q, kp, vp, slots, scale, 1.0, 1.0, kvh, out)
    o.prefill_attention_paged(q.float(), kp, vp, slots, scale, 1.0, 1.0, kvh, wide)
    ref = _causal_reference(q.float(), kp.view(-1, kvh, d).float(), vp.view(-1, kvh, d).float(),
                            slots, scale)
    err = (out.double() - ref).abs().max().item() / ref.abs().max().item()
    assert err < 1e-2, err
    assert torch.equal(out, wide) != _dot_order(), "the bf16 order where vdpbf16ps serves"
    qd = q[-4:].reshape(4, kvh, groups, d)  # decode: four rows of the last positions
    lens = [ctx - 3, ctx - 2, ctx - 1, ctx]
    table = torch.stack([slots if i == 3 else torch.cat([slots[:lens[i]], slots[:ctx - lens[i]]])
                         for i in range(4)])
    bias = _pad_bias(lens)
    dec = o.decode_attention_paged(qd, kp, vp, table.view(-1), bias, scale)
    assert torch.equal(dec.view(4, h, d), out[-4:])
    dwide = o.decode_attention_paged(qd.float(), kp, vp, table.view(-1), bias, scale)
    assert torch.equal(dwide.view(4, h, d), wide[-4:])
    assert torch.equal(dec, dwide) != _dot_order()
    # head_dim 48: the widening order in both kernels (a bf16 query equals its float32 copy)
    kp, vp = _pools(g, 20, page, 1, 48)
    q48 = torch.randn(40, 2, 48, generator=g).bfloat16()
    a, b = torch.empty(40, 2, 48), torch.empty(40, 2, 48)
    o.prefill_attention_paged(q48, kp, vp, slots[:100] % 320, 0.2, 1.0, 1.0, 1, a)
    o.prefill_attention_paged(q48.float(), kp, vp, slots[:100] % 320, 0.2, 1.0, 1.0, 1, b)
    assert torch.equal(a, b)


def test_a_bf16_pool_of_a_bf16_model_is_never_viewed() -> None:
    """The decode K/V view holds float32 copies that the view's kernel attends in the widening
    order; a bf16 model's bf16 pool is read in place instead (decode_view.bf16_pool), so its
    decode rows take the prefill kernel's order. A float32 model over a bf16 pool, or a bf16
    model over a float32 pool, keeps the rule it had."""
    from pdcore.engine.model.decode_view import bf16_pool

    bf, f32 = torch.zeros(1, dtype=torch.bfloat16), torch.zeros(1)
    assert bf16_pool(bf, bf) and not bf16_pool(f32, bf) and not bf16_pool(bf, f32)
