"""The native attention kernels against float64 references: decode attention (dense and over
the paged pool, read in place) and the causal prefill kernel over the paged pool. Split from
test_native.py (its helpers are shared); test_native_isa.py runs this file on every ISA too."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from test_native import _ops, _panels


@pytest.mark.parametrize("d", [32, 64, 128])
@pytest.mark.parametrize("groups", [1, 3, 8])
def test_decode_attention_matches_float64(d: int, groups: int) -> None:
    o = _panels()
    g = torch.Generator().manual_seed(d + groups)
    b, h, cap = 5, 2, 96
    for width in (1, 17, 80):
        q = torch.randn(b, h, groups, d, generator=g)
        # K/V as the decode view hands them over: a slice of wider buffers (strided rows)
        k = torch.randn(b, h, cap, d, generator=g)[:, :, :width]
        v = torch.randn(b, h, cap, d, generator=g)[:, :, :width]
        lens = torch.randint(1, width + 1, (b,), generator=g)
        lens[0] = width
        bias = torch.zeros(b, 1, 1, width).masked_fill_(
            ~(torch.arange(width)[None] < lens[:, None])[:, None, None, :], float("-inf"))
        # padded positions hold garbage (NaN must not leak through a zero weight either way)
        for mask in (None, bias):
            ref = F.scaled_dot_product_attention(
                q.double(), k.double(), v.double(),
                attn_mask=None if mask is None else mask.double(), scale=d**-0.5)
            got = o.decode_attention(q, k, v, mask, d**-0.5)
            assert got.shape == (b, h, groups, d)
            assert (got.double() - ref).abs().max().item() < 2e-6, (width, mask is None)


def _pad_bias(lens: list[int]) -> torch.Tensor:
    """The additive mask [b, 1, 1, max(lens)] of rows `lens` long, padded to the longest: 0
    where a row has a key, -inf past its end."""
    w = max(lens)
    return torch.zeros(len(lens), 1, 1, w).masked_fill_(
        ~(torch.arange(w)[None] < torch.tensor(lens)[:, None])[:, None, None, :], float("-inf"))


def _padded_group(pos: int, slots: torch.Tensor, other: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode group around the row at `pos` (its context: slots[: pos + 1], row 1): a longer
    context and a shorter one of `other`'s slots beside it, padded to the longest and masked;
    (table [3, w], bias [3, 1, 1, w])."""
    lens = [pos + 40, pos + 1, max(1, pos // 3)]
    w = max(lens)
    table = torch.zeros(3, w, dtype=torch.long)
    table[0], table[1, : pos + 1] = other[:w], slots[: pos + 1]
    table[2, : lens[2]] = other[: lens[2]].flip(0)
    return table, _pad_bias(lens)


def _paged_equals_gathered(o, kp, vp, kf, vf, table, lens, groups, g):  # type: ignore
    """Random queries over the slots `table` names (rows of `lens`, padded and masked): the
    paged kernel equals to the bit the kernel over the gathered rows, and float64 SDPA within
    2e-6. The paged kernel's output."""
    b, w, kvh, d = len(lens), max(lens), kf.shape[-2], kf.shape[-1]
    bias = None if b == 1 else _pad_bias(lens)
    q = torch.randn(b, kvh, groups, d, generator=g)
    kb = kf.index_select(0, table).view(b, w, kvh, d).transpose(1, 2)
    vb = vf.index_select(0, table).view(b, w, kvh, d).transpose(1, 2)
    got = o.decode_attention_paged(q, kp, vp, table, bias, d**-0.5)
    assert torch.equal(got, o.decode_attention(q, kb, vb, bias, d**-0.5)), lens
    ref = F.scaled_dot_product_attention(
        q.double(), kb.double(), vb.double(),
        attn_mask=None if bias is None else bias.double(), scale=d**-0.5)
    assert (got.double() - ref).abs().max().item() < 2e-6, lens
    return got


def _paged_cases(o, kp: torch.Tensor, vp: torch.Tensor, kf: torch.Tensor, vf: torch.Tensor,
                 batches: tuple[list[int], ...], groups: int, g: torch.Generator) -> None:
    """Each batch of context lengths on scattered slots of the pool [pages, page, kvh, d]: the
    paged kernel equals the gathered path (_paged_equals_gathered); then a slot outside the
    pool (one past the end, -1) is an error, not a read."""
    pages, page, kvh, d = kp.shape
    for lens in batches:
        table = torch.zeros(len(lens), max(lens), dtype=torch.long)
        for i, n in enumerate(lens):
            table[i, :n] = torch.randperm(pages * page, generator=g)[:n]
        _paged_equals_gathered(o, kp, vp, kf, vf, table.view(-1), lens, groups, g)
    q = torch.randn(1, kvh, groups, d, generator=g)
    table = torch.randperm(pages * page, generator=g)[:700]
    for bad in (pages * page, -1):
        table[5] = bad
        with pytest.raises(RuntimeError, match="outside the pool"):
            o.decode_attention_paged(q, kp, vp, table, None, 0.125)


@pytest.mark.parametrize("groups", [1, 3, 4])
def test_paged_decode_attention_reads_the_pool_in_place(groups: int) -> None:
    """At a long context (3,000 slots, scattered in a paged pool), the paged kernel equals to
    the bit the kernel over the gathered rows (the view's path), and float64 SDPA closely; a
    padded batch masked alike; a slot outside the pool is an error, not a read."""
    o = _panels()
    g = torch.Generator().manual_seed(groups)
    kvh, d, pages, page = 2, 64, 400, 8
    kp = torch.randn(pages, page, kvh, d, generator=g)
    vp = torch.randn(pages, page, kvh, d, generator=g)
    _paged_cases(o, kp, vp, kp.view(-1, kvh, d), vp.view(-1, kvh, d),
                 ([3000], [3000, 17, 1500]), groups, g)


@pytest.mark.parametrize("groups", [1, 3, 4])
def test_paged_decode_attention_reads_a_bf16_pool_in_place(groups: int) -> None:
    """A bf16 pool (a bf16 model's) is read in place, each value widened as it is loaded: the
    paged kernel equals to the bit the kernel over float32 copies of the gathered rows (what a
    bf16 model's float32 decode view holds), whole and in parts, alone and in a padded batch;
    and its slots are checked as the float32 pool's are (a gather would fail otherwise)."""
    o = _panels()
    g = torch.Generator().manual_seed(100 + groups)
    kvh, d, pages, page = 2, 64, 400, 8
    kp = torch.randn(pages, page, kvh, d, generator=g).bfloat16()
    vp = torch.randn(pages, page, kvh, d, generator=g).bfloat16()
    _paged_cases(o, kp, vp, kp.float().view(-1, kvh, d), vp.float().view(-1, kvh, d),
                 ([3000], [700], [3000, 17, 1500], [5, 9]), groups, g)


@pytest.mark.parametrize("kvh,d", [(1, 64), (8, 64), (2, 128)])
def test_long_decode_attention_in_parts_matches_float64(kvh: int, d: int) -> None:
    """Past two parts of keys (attention.h: da_part_len, 512 / 128 / 256 keys for these
    shapes, for the view's kernel; dp_part_len for the paged one), where tasks are fewer than
    two a thread (one KV head alone: always), a sequence's keys are attended in parts joined by
    their max and sum: at the edge of the view's rule and past it, for one long sequence alone
    and a padded batch whose short rows leave whole parts masked, the view's kernel and the
    paged one agree to the bit and both stay within 2e-6 of float64 (whole or in parts)."""
    o = _panels()
    g = torch.Generator().manual_seed(kvh * d)
    part = max(64, (256 * 1024 // (2 * kvh * d * 4)) // 64 * 64)
    slots = 4 * part + 50
    kp = torch.randn(slots, kvh, d, generator=g)
    vp = torch.randn(slots, kvh, d, generator=g)
    for lens in ([2 * part - 1], [2 * part], [4 * part + 7], [4 * part + 7, 5, part + 1]):
        b, w = len(lens), max(lens)
        table = torch.zeros(b, w, dtype=torch.long)
        for i, n in enumerate(lens):
            table[i, :n] = torch.randperm(slots, generator=g)[:n]
        got = _paged_equals_gathered(o, kp, vp, kp, vp, table.view(-1), lens, 4, g)
        assert not got.isnan().any(), lens


@pytest.mark.parametrize("kvh,groups,d", [(8, 4, 64), (3, 3, 64), (2, 1, 128)])
def test_paged_decode_attention_has_the_same_bits_at_any_thread_count(kvh, groups, d) -> None:
    """The paged kernel reads all KV heads of a slot row at once (attention.h: attend_heads),
    a task per sequence, in parts where sequences are fewer than two a thread (dp_use_parts,
    parts sized by the thread count): at 1, 2 and 3 threads, one long sequence (in parts) and
    a padded batch of five (whole at 1-2 threads, in parts at 3) over scattered slots give the
    same bits as each other and as the view's kernel over the gathered rows (head by head)."""
    o = _panels()
    g = torch.Generator().manual_seed(kvh * groups * d)
    slots = 3000
    kp = torch.randn(slots, kvh, d, generator=g)
    vp = torch.randn(slots, kvh, d, generator=g)
    before = torch.get_num_threads()
    seen: dict[tuple[int, ...], torch.Tensor] = {}
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            for lens in ([2100], [700, 5, 64, 1300, 129]):
                gq = torch.Generator().manual_seed(len(lens))
                table = torch.zeros(len(lens), max(lens), dtype=torch.long)
                for i, n in enumerate(lens):
                    table[i, :n] = torch.randperm(slots, generator=gq)[:n]
                got = _paged_equals_gathered(o, kp, vp, kp, vp, table.view(-1), lens, groups, gq)
                key = tuple(lens)
                assert torch.equal(got, seen.setdefault(key, got)), (threads, lens)
    finally:
        torch.set_num_threads(before)


def _causal_reference(q, kf, vf, slots, scale):
    """float64 causal attention of q [n, H, D], the last n positions of the context `slots`
    of kf / vf [S, KVH, D] (already widened to float)."""
    n, h, ctx, kvh = q.shape[0], q.shape[1], slots.numel(), kf.shape[1]
    k = kf.double()[slots].transpose(0, 1).repeat_interleave(h // kvh, 0)
    v = vf.double()[slots].transpose(0, 1).repeat_interleave(h // kvh, 0)
    mask = torch.arange(ctx)[None] <= torch.arange(ctx - n, ctx)[:, None]
    return F.scaled_dot_product_attention(q.double().transpose(0, 1), k, v, attn_mask=mask,
                                          scale=scale).transpose(0, 1)


@pytest.mark.parametrize("pool", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_prefill_attention_matches_float64(pool: torch.dtype) -> None:
    """The causal prefill kernel over a paged pool (scattered slots, read in place): whole
    prompts and chunks after a prefix, odd lengths, 1 to 8 query heads per KV head, head_dim
    32 to 128, queries strided as the qkv pack hands them over; within 1e-4 of float64 (relative
    to the output's scale), the pool's values widened as the Python path widens them."""
    o = _panels()
    g = torch.Generator().manual_seed(47)
    scales = (0.5, 2.0) if pool == torch.float8_e4m3fn else (1.0, 1.0)
    for kvh, groups, d, n, ctx in ((3, 3, 64, 2, 2), (3, 3, 64, 37, 37), (3, 3, 64, 100, 357),
                                   (2, 1, 32, 65, 65), (1, 8, 128, 70, 200),
                                   (2, 4, 64, 129, 300), (2, 2, 16, 40, 90),
                                   (3, 3, 64, 515, 1027)):
        if pool != torch.float32 and ctx > 400:
            break  # (the last case)
        h, pages, page = kvh * groups, ctx // 16 + 8, 16
        kp = torch.randn(pages, page, kvh, d, generator=g)
        vp = torch.randn(pages, page, kvh, d, generator=g)
        kp, vp = (kp / scales[0]).to(pool), (vp / scales[1]).to(pool)
        slots = torch.randperm(pages * page, generator=g)[:ctx]
        qkv = torch.randn(n, h * d + 2 * kvh * d, generator=g)
        q = qkv[:, : h * d].view(n, h, d)
        got = o.prefill_attention_paged(q, kp, vp, slots, d**-0.5, *scales, kvh)
        assert got.shape == (n, h, d) and got.dtype == torch.float32
        ref = _causal_reference(q, kp.view(-1, kvh, d).float() * scales[0],
                                vp.view(-1, kvh, d).float() * scales[1], slots, d**-0.5)
        err = (got.double() - ref).abs().max().item() / ref.abs().max().item()
        assert err < 1e-4, (kvh, groups, d, n, ctx, err)
        rows = torch.full((n + 3, h, d), float("nan"))  # `out`: rows 1 .. n of a step's output
        o.prefill_attention_paged(q, kp, vp, slots, d**-0.5, *scales, kvh, rows[1 : n + 1])
        assert torch.equal(rows[1 : n + 1], got) and rows[0].isnan().all() \
            and rows[n + 1 :].isnan().all()
        if pool == torch.bfloat16:  # bf16 queries (a bf16 model): the result in bf16
            gb = o.prefill_attention_paged(q.bfloat16(), kp, vp, slots, d**-0.5, 1.0, 1.0, kvh)
            assert gb.dtype == torch.bfloat16
            gout = torch.zeros(n, h, d, dtype=torch.bfloat16)
            o.prefill_attention_paged(q.bfloat16(), kp, vp, slots, d**-0.5, 1.0, 1.0, kvh, gout)
            assert torch.equal(gout, gb)
            ref = _causal_reference(q.bfloat16().float(), kp.view(-1, kvh, d).float(),
                                    vp.view(-1, kvh, d).float(), slots, d**-0.5)
            assert (gb.double() - ref).abs().max().item() < 2e-2
    for bad in (kp.shape[0] * 16, -1):  # the last pool run: a slot outside it is refused
        slots[3] = bad
        with pytest.raises(RuntimeError, match="outside the pool"):
            o.prefill_attention_paged(q, kp, vp, slots, 0.125, *scales, kp.shape[2])
    # head_dim 24: no kernel; the gathered rows through SDPA, the same answer
    kp, vp = torch.randn(8, 16, 2, 24, generator=g), torch.randn(8, 16, 2, 24, generator=g)
    slots, q = torch.randperm(128, generator=g)[:50], torch.randn(20, 4, 24, generator=g)
    got = o.prefill_attention_paged(q, kp, vp, slots, 0.2, 1.0, 1.0, 2)
    ref = _causal_reference(q, kp.view(-1, 2, 24), vp.view(-1, 2, 24), slots, 0.2)
    assert (got.double() - ref).abs().max().item() < 1e-5
    out = torch.zeros(20, 4, 24)
    o.prefill_attention_paged(q, kp, vp, slots, 0.2, 1.0, 1.0, 2, out)
    assert torch.equal(out, got)
    with pytest.raises(RuntimeError, match="out is not"):
        o.prefill_attention_paged(q, kp, vp, slots, 0.2, 1.0, 1.0, 2, torch.zeros(20, 4, 25))


@pytest.mark.parametrize("kvh,groups,d,ctx", [(3, 3, 64, 400), (1, 8, 64, 1100), (2, 4, 128, 300),
                                              (2, 1, 32, 130)])
def test_a_rows_attention_has_the_same_bits_in_every_phase(kvh, groups, d, ctx) -> None:
    """Batch- and phase-invariant attention (#48: int8 activations turn a last-bit difference
    into a whole rounding step): the query at position p gets the same bits whether the causal
    prefill kernel computes it (the whole prompt, or a chunk after a prefix), the paged decode
    kernel alone (a long context: in parts, attention.h), in a padded decode group among
    longer and shorter contexts, or the view's dense kernel (strided rows)."""
    o = _panels()
    g = torch.Generator().manual_seed(ctx + d)
    h, page = kvh * groups, 16
    pages = (2 * ctx + 100) // page
    kp = torch.randn(pages, page, kvh, d, generator=g)
    vp = torch.randn(pages, page, kvh, d, generator=g)
    kf, vf = kp.view(-1, kvh, d), vp.view(-1, kvh, d)
    perm = torch.randperm(pages * page, generator=g)
    slots, other = perm[:ctx], perm[ctx : 2 * ctx + 40]  # another, longer sequence's slots
    q = torch.randn(ctx, h + 2 * kvh, d, generator=g)[:, :h]  # strided, as the qkv pack
    scale = d**-0.5
    whole = o.prefill_attention_paged(q, kp, vp, slots, scale, 1.0, 1.0, kvh)
    for cut in (1, 64, ctx // 2 + 5):  # a chunk after a prefix of `cut` positions
        part = o.prefill_attention_paged(q[cut:], kp, vp, slots, scale, 1.0, 1.0, kvh)
        assert torch.equal(part, whole[cut:]), cut
    for pos in (0, 15, 63, 64, 200, ctx - 1):
        if pos >= ctx:
            continue
        want = whole[pos].view(1, kvh, groups, d)
        qb = q[pos].reshape(1, kvh, groups, d)
        lone = o.decode_attention_paged(qb, kp, vp, slots[: pos + 1], None, scale)
        assert torch.equal(lone, want), ("lone decode", pos)
        # a decode group: a longer context, this one, a shorter one (padded, masked)
        table, bias = _padded_group(pos, slots, other)
        qg = torch.randn(3, kvh, groups, d, generator=g)
        qg[1] = qb[0]
        grp = o.decode_attention_paged(qg, kp, vp, table.view(-1), bias, scale)
        assert torch.equal(grp[1:2], want), ("decode group", pos)
        kb = kf.index_select(0, table.view(-1)).view(*table.shape, kvh, d).transpose(1, 2)
        vb = vf.index_select(0, table.view(-1)).view(*table.shape, kvh, d).transpose(1, 2)
        dense = o.decode_attention(qg, kb, vb, bias, scale)
        assert torch.equal(dense[1:2], want), ("the view's kernel", pos)
