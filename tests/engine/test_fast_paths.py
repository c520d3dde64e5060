"""The engine's CPU fast paths give the same numbers as the plain ones:

- linear layers on oneDNN-reordered weights (layers.linear), which replace the originals,
  against F.linear;
- batched decode attention (one padded gather + masked SDPA for every one-token sequence of a
  step) against one SDPA per sequence, in a step that mixes decodes of different context
  lengths with a prefill chunk, and in a decode-only step (its output skips the scatter);
- the decode K/V view (decode_view.py: contexts kept contiguous between steps, appended to)
  against gathering from the pool, over consecutive steps, a changed batch, a table that does
  not continue, a mixed step and a failed forward.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdcore.engine.model import layers
from pdcore.engine.model.batch import ForwardBatch, SeqSpan
from pdcore.engine.model.llama import LlamaForCausalLM
from pdcore.errors import ConfigError
from pdserve_testing import random_llama

needs_mkl = pytest.mark.skipif(
    not (torch.backends.mkldnn.is_available()
         and hasattr(torch.ops.mkldnn, "_linear_pointwise")),
    reason="this torch build has no oneDNN linear")


@needs_mkl
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(bias: bool) -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=g)
    b = torch.randn(96, generator=g) if bias else None
    packed = layers.pack_weight(w)
    assert packed is not None
    gone = layers.stand_in(w)  # the reordered weight is all `linear` reads
    assert gone.untyped_storage().nbytes() == w.element_size() and gone.shape == w.shape
    for m in [*range(1, 24), 100, 600]:
        x = torch.randn(m, 64, generator=g)
        got = layers.linear(x, gone, b, packed)
        assert got.shape == (m, 96)
        torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    x3 = torch.randn(2, 5, 64, generator=g)
    torch.testing.assert_close(layers.linear(x3, gone, b, packed), F.linear(x3, w, b),
                               rtol=1e-5, atol=1e-5)


@needs_mkl
def test_packing_follows_env_and_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    w = torch.randn(32, 16)
    assert layers.pack_weight(w.to(torch.float16)) is None  # float32 and bfloat16 only
    monkeypatch.setenv(layers.PACKED_GEMM_ENV, "0")
    assert layers.pack_weight(w) is None
    monkeypatch.setenv(layers.PACKED_GEMM_ENV, "1")
    assert layers.pack_weight(w) is not None


def _tiny_model(packed: bool, monkeypatch: pytest.MonkeyPatch) -> LlamaForCausalLM:
    monkeypatch.setenv(layers.PACKED_GEMM_ENV, "1" if packed else "0")
    model = random_llama(0.2, vocab_size=300, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512)
    model.prepare_for_inference()
    return model


def _mixed_step() -> tuple[ForwardBatch, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Three decodes (contexts 3, 17, 40 in scattered slots) and a 5-token prefill chunk."""
    g = torch.Generator().manual_seed(1)
    pages, page = 16, 8
    kv = [(torch.randn(pages, page, 2, 16, generator=g), torch.randn(pages, page, 2, 16, generator=g))
          for _ in range(2)]
    perm = torch.randperm(pages * page, generator=g)
    ctx_lens, off, seqs, out_slots, positions = [3, 17, 40, 5], 0, [], [], []
    used = 0
    for i, n in enumerate(ctx_lens):
        slots = perm[used : used + n]
        used += n
        q_len = 5 if i == 3 else 1
        seqs.append(SeqSpan(off, q_len, slots))
        out_slots.extend(slots[n - q_len :].tolist())
        positions.extend(range(n - q_len, n))
        off += q_len
    batch = ForwardBatch(input_ids=torch.randint(3, 300, (off,), generator=g),
                         positions=torch.tensor(positions), out_slots=torch.tensor(out_slots),
                         seqs=seqs, logit_rows=torch.arange(off))
    return batch, kv


def _clone(batch: ForwardBatch, kv: list) -> tuple[ForwardBatch, list]:
    return (ForwardBatch(batch.input_ids, batch.positions, batch.out_slots, batch.seqs,
                         batch.logit_rows), [(k.clone(), v.clone()) for k, v in kv])


def test_batched_decode_attention_matches_per_sequence(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _tiny_model(packed=False, monkeypatch=monkeypatch)
    batch, kv = _mixed_step()
    b1, kv1 = _clone(batch, kv)
    fast = model(b1, kv1)
    assert b1.decode_group() is not None and len(b1.decode_group().seqs) == 3
    b2, kv2 = _clone(batch, kv)
    monkeypatch.setattr(ForwardBatch, "decode_group", lambda self: None)
    slow = model(b2, kv2)
    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-5)
    for (k1, v1), (k2, v2) in zip(kv1, kv2):  # both wrote the same new K/V
        torch.testing.assert_close(k1, k2, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v1, v2, rtol=1e-5, atol=1e-5)


@needs_mkl
def test_packed_model_matches_unpacked(monkeypatch: pytest.MonkeyPatch) -> None:
    batch, kv = _mixed_step()  # 8 rows: the packed path
    plain = _tiny_model(packed=False, monkeypatch=monkeypatch)
    fast = _tiny_model(packed=True, monkeypatch=monkeypatch)
    assert fast.lm_head_packed is not None and plain.lm_head_packed is None
    for m in fast.modules():  # one copy of the weights: the originals are gone
        if isinstance(m, (layers.ColumnLinear, layers.RowLinear)):
            assert m.packed is not None and m.weight.untyped_storage().nbytes() <= 4
    torch.testing.assert_close(fast(*_clone(batch, kv)), plain(*_clone(batch, kv)),
                               rtol=1e-5, atol=1e-5)


def test_decode_only_step_matches_per_sequence(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _tiny_model(packed=True, monkeypatch=monkeypatch)
    full, kv = _mixed_step()
    dec = [s for s in full.seqs if s.q_len == 1]
    rows = torch.tensor([s.q_start for s in dec])
    seqs = [SeqSpan(i, 1, s.ctx_slots) for i, s in enumerate(dec)]
    batch = ForwardBatch(full.input_ids[rows], full.positions[rows], full.out_slots[rows], seqs,
                         torch.arange(len(dec)))
    b1, kv1 = _clone(batch, kv)
    fast = model(b1, kv1)
    assert b1.decode_group() is not None and b1.decode_group().whole
    b2, kv2 = _clone(batch, kv)
    monkeypatch.setattr(ForwardBatch, "decode_group", lambda self: None)
    torch.testing.assert_close(fast, model(b2, kv2), rtol=1e-5, atol=1e-5)


def _decode_run(seed: int = 3) -> tuple[list[list[int]], torch.Tensor, int]:
    """Three decoding sequences (contexts 3, 17, 40) in scattered pool slots, and slots left
    over for the tokens they add."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(16 * 8, generator=g)
    tables, used = [], 0
    for n in (3, 17, 40):
        tables.append(perm[used : used + n].tolist())
        used += n
    return tables, perm[used:], used


def _decode_batch(tables: list[list[int]], keys: list[object] | None, seed: int) -> ForwardBatch:
    g = torch.Generator().manual_seed(seed)
    seqs = [SeqSpan(i, 1, torch.tensor(t), key=None if keys is None else keys[i])
            for i, t in enumerate(tables)]
    return ForwardBatch(torch.randint(3, 300, (len(tables),), generator=g),
                        torch.tensor([len(t) - 1 for t in tables]),
                        torch.tensor([t[-1] for t in tables]), seqs, torch.arange(len(tables)))


def test_decode_kv_view_matches_gathering(monkeypatch: pytest.MonkeyPatch) -> None:
    viewed = _tiny_model(packed=True, monkeypatch=monkeypatch)
    plain = _tiny_model(packed=True, monkeypatch=monkeypatch)  # same seed: same weights
    _, kv = _mixed_step()
    kv1, kv2 = [(k.clone(), v.clone()) for k, v in kv], [(k.clone(), v.clone()) for k, v in kv]
    tables, spare, _ = _decode_run()
    spare = iter(spare.tolist())
    keys: list[object] = ["a", "b", "c"]
    modes = []

    def step(seed: int, check_mode: str | None = None) -> None:
        batch = _decode_batch(tables, keys, seed)
        got = viewed(batch, kv1)
        modes.append(viewed.decode_kv.mode)
        if check_mode is not None:
            assert modes[-1] == check_mode, modes
        want = plain(_decode_batch(tables, None, seed), kv2)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    for j in range(4):  # fill, then appends
        step(j, "fill" if j == 0 else "append")
        for t in tables:
            t.append(next(spare))
    tables.pop(1)  # a sequence left the batch: the rows changed
    keys.pop(1)
    step(10, "fill")
    tables[0].append(next(spare))
    tables[1].append(next(spare))
    tables[1][0] = tables[1][-2]  # no longer one token further along the same slots
    step(11, "fill")
    # a mixed step (prefill + decode) gathers and leaves the view invalid
    mixed, _ = _mixed_step()
    viewed(mixed, [(k.clone(), v.clone()) for k, v in kv])
    assert viewed.decode_kv.mode == "" and not viewed.decode_kv.valid
    for t in tables:
        t.append(next(spare))
    step(12, "fill")
    for t in tables:
        t.append(next(spare))

    def boom(x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("injected")

    if viewed.native is not None:  # the native decode loop fails inside, after the view began
        monkeypatch.setitem(viewed.native, "op", lambda *a: boom(a[0]))
    else:
        monkeypatch.setattr(viewed.layers[1].mlp, "forward", boom)
    with pytest.raises(RuntimeError, match="injected"):
        viewed(_decode_batch(tables, keys, 13), kv1)
    assert not viewed.decode_kv.valid  # half-updated buffers are never appended to
    monkeypatch.undo()
    step(13, "fill")
    for t in tables:
        t.append(next(spare))
    # decodes riding along a prefill chunk keep appending; the chunk attends as before
    chunk = [next(spare) for _ in range(5)]

    def mixed_batch(keyed: bool) -> ForwardBatch:
        b = _decode_batch(tables, keys if keyed else None, 14)
        n = len(tables)
        seqs = [*b.seqs, SeqSpan(n, 5, torch.tensor(chunk), key="p" if keyed else None)]
        return ForwardBatch(torch.cat([b.input_ids, torch.arange(10, 15)]),
                            torch.cat([b.positions, torch.arange(5)]),
                            torch.cat([b.out_slots, torch.tensor(chunk)]), seqs,
                            torch.arange(n + 5))

    got = viewed(mixed_batch(True), kv1)
    assert viewed.decode_kv.mode == "append"
    torch.testing.assert_close(got, plain(mixed_batch(False), kv2), rtol=1e-5, atol=1e-5)
    for t in tables:
        t.append(next(spare))
    step(15, "append")
    # the server went idle: the buffers go, and the next decode step fills them again
    viewed.decode_kv.release()
    assert not viewed.decode_kv.k and not viewed.decode_kv.valid
    for t in tables:
        t.append(next(spare))
    step(16, "fill")


def test_a_float32_pool_is_read_in_place_not_viewed(monkeypatch: pytest.MonkeyPatch) -> None:
    """`prefer_pool` (a packed GGUF model's, s11): a float32 model over a float32 pool keeps no
    decode K/V view, the paged kernel reads the pool in place, nothing is allocated beside it,
    and the logits are the viewed twin's (the default), step after step."""
    from pdcore.engine.model.decode_view import reads_in_place

    model = _tiny_model(packed=True, monkeypatch=monkeypatch)
    viewed = _tiny_model(packed=True, monkeypatch=monkeypatch)  # same seed: same weights
    model.decode_kv.prefer_pool = True
    _, kv = _mixed_step()
    if not reads_in_place(torch.zeros(1), kv[0][0]):
        pytest.skip("no native paged decode kernel here: the view serves as before")
    kv1, kv2 = [(k.clone(), v.clone()) for k, v in kv], [(k.clone(), v.clone()) for k, v in kv]
    tables, spare, _ = _decode_run()
    spare = iter(spare.tolist())
    for j in range(3):
        got = model(_decode_batch(tables, ["a", "b", "c"], j), kv1)
        want = viewed(_decode_batch(tables, ["a", "b", "c"], j), kv2)
        assert model.decode_kv.mode == "" and not model.decode_kv.k
        assert viewed.decode_kv.mode == ("fill" if j == 0 else "append")
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for t in tables:
            t.append(next(spare))
    # bf16 activations and pools are read in place (s12, #47); a float16 one keeps the view
    assert reads_in_place(torch.zeros(1, dtype=torch.bfloat16), kv[0][0])
    assert reads_in_place(torch.zeros(1), kv[0][0].to(torch.bfloat16))
    assert not reads_in_place(torch.zeros(1, dtype=torch.float16), kv[0][0])
    assert not reads_in_place(torch.zeros(1), kv[0][0].to(torch.float16))
    # FP8 pools too (s13: widened and scaled as loaded, native/fp8_load.h)
    assert reads_in_place(torch.zeros(1, dtype=torch.bfloat16), kv[0][0].to(torch.float8_e5m2))


def test_decode_kv_view_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    from pdcore.engine.model import decode_view

    monkeypatch.setenv(decode_view.VIEW_MB_ENV, "0")
    model = _tiny_model(packed=False, monkeypatch=monkeypatch)
    _, kv = _mixed_step()
    tables, _, _ = _decode_run()
    model(_decode_batch(tables, ["a", "b", "c"], 0), kv)
    assert model.decode_kv.mode == "" and not model.decode_kv.k  # off: nothing allocated
    assert decode_view.DecodeKV(2, 2, 16, budget=10**6)._ensure(3, 40, torch.float32)
    assert not decode_view.DecodeKV(2, 2, 16, budget=10**3)._ensure(3, 40, torch.float32)
    for bad in ("lots", "-1", "nan"):
        monkeypatch.setenv(decode_view.VIEW_MB_ENV, bad)
        with pytest.raises(ConfigError, match=decode_view.VIEW_MB_ENV):
            decode_view.budget_bytes()
