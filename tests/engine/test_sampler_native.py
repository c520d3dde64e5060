"""The native sampling pass (engine/native/sampler.h, #47 item 1): the distributions it draws
from are the per-row reference's (pdcore/testing/sampling_ref.py), its draws follow them and
match the torch path's for the same uniforms, and the edits it makes (penalties, logit bias,
bans, the grammar's bitmask) are the torch path's. test_native_isa.py runs this file again
with every other ISA's library this CPU has (AVX2 included)."""

from __future__ import annotations

import pytest
import torch

from pdcore.engine import native
from pdcore.engine.sched import sampler_native as sn
from pdcore.engine.sched.sampler import SampleState, _penalize, draw, processed_probs, sample
from pdcore.messages.io import SamplingParams
from pdcore.testing.sampling_ref import reference_probs

KNOBS = [dict(temperature=1.0), dict(temperature=0.2, top_p=0.9),
         dict(temperature=1.0, top_p=0.95), dict(temperature=0.7, top_k=40, top_p=0.8),
         dict(temperature=1.3, min_p=0.05), dict(temperature=1.0, top_p=0.5, min_p=0.01),
         dict(temperature=1.0, top_k=1), dict(temperature=2.0, top_p=0.999),
         dict(temperature=0.9, top_k=200), dict(temperature=0.0)]
TINY = torch.finfo(torch.float32).tiny


@pytest.fixture(scope="module")
def op():
    o = sn.op()
    if o is None:
        pytest.skip(f"native kernels unavailable here: {native.status()}")
    return o


def _states(knobs: list[dict], prompt: list[int] | None = None) -> list[SampleState]:
    return [SampleState.create(SamplingParams(**k), prompt or [1]) for k in knobs]


def _nucleus_edge(want: torch.Tensor, top_p: float) -> torch.Tensor:
    """|mass more likely than each token - top_p|: top-p's rule is decided by float32 rounding
    (the reference's probabilities sum to 1 within ~1e-7) where this is about that small."""
    sp, si = torch.sort(want.double(), descending=True)
    gap = torch.empty_like(sp)
    gap[si] = (torch.cumsum(sp, 0) - sp - top_p).abs()
    return gap


@pytest.mark.parametrize("vocab", [4093, 49152])
def test_native_filtering_equals_the_per_row_reference(op, vocab: int) -> None:
    g = torch.Generator().manual_seed(0)
    for scale in (0.3, 1.0, 4.0, 12.0):  # flat to sharply peaked rows
        logits = torch.randn(len(KNOBS), vocab, generator=g) * scale
        states = _states(KNOBS)
        probs = torch.zeros(len(KNOBS), vocab)
        toks = sn.run(op, logits, states, torch.rand(len(KNOBS), generator=g).double(),
                      probs=probs)
        for i, st in enumerate(states):
            p = st.params
            if p.greedy:
                assert toks[i] == int(logits[i].argmax()), KNOBS[i]
                continue
            want = reference_probs(logits[i], p)
            assert probs[i, toks[i]] > 0, (scale, KNOBS[i])
            differ = (probs[i] > 0) != (want >= TINY)
            if p.top_p < 1.0:  # only tokens at the nucleus's edge, within float32 rounding
                assert bool((_nucleus_edge(want, p.top_p)[differ] < 1e-6).all()), (scale, p)
            else:
                assert not differ.any(), (scale, KNOBS[i])
            same = ~differ
            assert torch.allclose(probs[i][same], want[same], atol=1e-6), (scale, KNOBS[i])


def test_native_draws_are_the_torch_draws_and_follow_the_distribution(op) -> None:
    g = torch.Generator().manual_seed(1)
    base = torch.rand(300, generator=g) ** 4  # not a whole number of vectors
    base[::3] = 0.0  # a third of the tokens cannot be drawn
    logits = base.log()  # -inf where 0
    n, same = 40_000, 2_000
    u = torch.rand(n, generator=g)
    sts = _states([dict(temperature=1.0)]) * n
    tokens = sn.run(op, logits.expand(n, -1), sts, u.double())
    want = draw(torch.softmax(logits, -1).expand(same, -1), u[:same])
    assert sum(a != b for a, b in zip(tokens[:same], want, strict=True)) <= 1  # an edge's rounding
    t = torch.tensor(tokens)
    assert bool((base[t] > 0).all())
    freq = torch.bincount(t, minlength=300).double() / n
    want_p = base.double() / base.sum()
    assert float((freq - want_p).abs().sum()) / 2 < 0.06
    edge = sn.run(op, logits.expand(3, -1), sts[:3],
                  torch.tensor([0.0, 0.5, 1.0 - 2 ** -24], dtype=torch.float64))
    nz = base.nonzero().squeeze(1)
    assert all(base[e] > 0 for e in edge) and edge[0] == int(nz[0]) and edge[2] == int(nz[-1])


def test_native_edits_are_the_torch_paths(op) -> None:
    """Repetition, frequency and presence penalties, logit bias and min_new_tokens' bans:
    applied by the native pass as _penalize applies them, greedy rows included."""
    vocab = 3001
    g = torch.Generator().manual_seed(4)
    knobs = [dict(temperature=0.8, repetition_penalty=1.3, top_p=0.9),
             dict(temperature=1.0, frequency_penalty=0.7, presence_penalty=0.4, min_p=0.02),
             dict(temperature=1.2, logit_bias={5: 8.0, 17: -3.5, 3000: 2.0}, top_k=30),
             dict(temperature=1.0, min_new_tokens=4, stop_token_ids=[7, 9]),
             dict(temperature=0.0, repetition_penalty=2.0, frequency_penalty=1.5,
                  logit_bias={11: 4.0})]
    prompt = torch.randint(0, vocab, (300,), generator=g).tolist()
    states = [SampleState.create(SamplingParams(**k), prompt, eos_ids=(2,)) for k in knobs]
    for st in states:  # output tokens, some repeated
        for t in [3, 5, 3, 11, 900, 3]:
            st.observe(t)
    states[3].banned = [2, 7, 9]  # min_new_tokens' bans still on (EOS and the stop ids)
    logits = torch.randn(len(knobs), vocab, generator=g) * 3
    probs = torch.zeros(len(knobs), vocab)
    toks = sn.run(op, logits, states, torch.rand(len(knobs), generator=g).double(), probs=probs)
    for i, st in enumerate(states):
        row = _penalize(logits[i].clone(), st)
        if st.params.greedy:
            assert toks[i] == int(row.argmax())
            continue
        want = processed_probs(row.unsqueeze(0), [st.params])[0]
        assert torch.equal(probs[i] > 0, want > 0), knobs[i]
        assert torch.allclose(probs[i], want, atol=1e-6), knobs[i]
    assert probs[3, [2, 7, 9]].eq(0).all()  # banned: EOS and the stop ids


def test_native_grammar_bitmask(op) -> None:
    vocab = 200
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, vocab, generator=g)
    allowed = torch.rand(2, vocab, generator=g) < 0.3
    allowed[1] = False  # nothing allowed: that row alone fails
    words = (vocab + 31) // 32
    bits = torch.zeros(2, words * 32, dtype=torch.int64)
    bits[:, :vocab] = allowed.long()
    shifts = torch.arange(32, dtype=torch.int64)
    packed = (bits.view(2, words, 32) << shifts).sum(-1)
    bitmask = torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed).to(torch.int32)
    states = _states([dict(temperature=1.0)] * 3)
    probs = torch.zeros(3, vocab)
    toks = sn.run(op, logits, states, torch.tensor([0.3, 0.3, 0.3], dtype=torch.float64),
                  bitmask=bitmask, mask_rows=[0, 1, -1], probs=probs)
    want = torch.softmax(logits[0].masked_fill(~allowed[0], float("-inf")), -1)
    assert torch.allclose(probs[0], want, atol=1e-6) and bool(allowed[0, toks[0]])
    assert toks[1] == -1 and toks[2] >= 0


def test_bad_rows_fail_alone(op) -> None:
    vocab = 64
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(6))
    logits[1, 7] = float("nan")
    logits[2, 9] = float("inf")
    states = [SampleState.create(SamplingParams(temperature=1.0), [1]) for _ in range(3)]
    states.append(SampleState.create(SamplingParams(temperature=1.0, logit_bias={99: 1.0}), [1]))
    toks, _, errs = sample(logits, states, [None] * 4)
    assert toks[0] is not None and errs[0] is None
    assert toks[1] is None and errs[1][1] == 400 and toks[2] is None and errs[2][1] == 400
    assert toks[3] is None and errs[3] == ("token id 99 (logit_bias or stop_token_ids) is "
                                           "outside the vocabulary [0, 64)", 400)


def test_logprobs_come_from_the_native_pass(op, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each row's log-sum-exp is the sampling pass's own where the row is sampled as it is
    (temperature 1), a separate reduction otherwise; logprobs are log_softmax's either way."""
    vocab = 5000
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(4, vocab, generator=g) * 4
    knobs = [dict(temperature=1.0), dict(temperature=0.5, top_p=0.9),
             dict(temperature=1.0, logit_bias={3: 5.0}), dict(temperature=0.0)]
    states = _states(knobs)
    states[3] = SampleState.create(SamplingParams(temperature=0.0, repetition_penalty=1.2), [4])
    calls = []
    real = torch.log_softmax
    monkeypatch.setattr(torch, "log_softmax", lambda *a, **k: calls.append(1) or real(*a, **k))
    toks, entries, errs = sample(logits, states, [0, 3, 2, 1])
    assert not calls and all(e is None for e in errs)
    lp = real(logits, -1)
    for i, (value, tok, top) in enumerate(entries):
        assert tok == toks[i] and abs(value - float(lp[i, tok])) < 1e-5, i
        want = torch.topk(lp[i], [0, 3, 2, 1][i])
        assert [t for _, t in top or []] == want.indices.tolist()
        assert all(abs(a - b) < 1e-5 for (a, _), b in zip(top or [], want.values.tolist()))
