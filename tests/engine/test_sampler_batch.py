"""The batched sampler (#47 item 1): every non-greedy row filtered and drawn in one pass. It must
give the distribution the per-row sampler gave (written out below as the reference), keep a
seeded request's tokens whatever its batch, and keep one bad row from failing the others. The
torch path is tested here; the native pass against the same reference in test_sampler_native.py,
and sample() through both."""

from __future__ import annotations

import torch

import pytest

from pdcore.engine.sched import sampler_native
from pdcore.engine.sched.sampler import SampleState, draw, processed_probs, sample
from pdcore.messages.io import SamplingParams
from pdcore.testing.sampling_ref import reference_probs

V = 4096


KNOBS = [dict(temperature=1.0), dict(temperature=0.2, top_p=0.9),
         dict(temperature=1.0, top_p=0.95), dict(temperature=0.7, top_k=40, top_p=0.8),
         dict(temperature=1.3, min_p=0.05), dict(temperature=1.0, top_p=0.5, min_p=0.01),
         dict(temperature=1.0, top_k=1), dict(temperature=2.0, top_p=0.999)]


def test_batched_filtering_equals_the_per_row_reference() -> None:
    g = torch.Generator().manual_seed(0)
    for scale in (0.3, 1.0, 4.0, 12.0):  # flat to sharply peaked rows
        logits = torch.randn(len(KNOBS), V, generator=g) * scale
        params = [SamplingParams(**k) for k in KNOBS]
        got = processed_probs(logits.clone(), params)
        for i, p in enumerate(params):
            want = reference_probs(logits[i], p)
            # the same support, but for denormals (< 1.2e-38), which the sampler zeroes
            assert torch.equal(got[i] > 0, want >= torch.finfo(want.dtype).tiny), (scale, KNOBS[i])
            assert torch.allclose(got[i], want, atol=1e-6), (scale, KNOBS[i])


def test_draw_follows_the_distribution_and_never_picks_a_zero() -> None:
    g = torch.Generator().manual_seed(1)
    probs = torch.rand(1, 300, generator=g) ** 4  # not a whole number of draw blocks
    probs[0, ::3] = 0.0  # a third of the tokens cannot be drawn
    n, chunk = 40_000, 10_000
    tokens = torch.tensor([t for _ in range(n // chunk)
                           for t in draw(probs.expand(chunk, -1), torch.rand(chunk, generator=g))])
    assert bool((probs[0, tokens] > 0).all())
    freq = torch.bincount(tokens, minlength=300).double() / n
    want = probs[0].double() / probs[0].sum()
    # the total variation distance of 40k draws over 200 live tokens is ~0.03 by chance alone
    assert float((freq - want).abs().sum()) / 2 < 0.06
    edge = draw(probs.expand(3, -1), torch.tensor([0.0, 0.5, 1.0 - 2 ** -24]))
    assert all(probs[0, t] > 0 for t in edge)
    assert edge[0] == int(probs[0].nonzero()[0]) and edge[2] == int(probs[0].nonzero()[-1])


@pytest.fixture(params=["native", "torch"])
def path(request, monkeypatch: pytest.MonkeyPatch) -> str:
    """sample() through the native pass (where built) and through the torch path."""
    if request.param == "native" and sampler_native.op() is None:
        pytest.skip("native kernels unavailable here")
    if request.param == "torch":
        monkeypatch.setattr(sampler_native, "op", lambda: None)
    return request.param


def _run(states: list[SampleState], rows: torch.Tensor, steps: int) -> list[list[int | None]]:
    out: list[list[int | None]] = [[] for _ in states]
    for s in range(steps):
        toks, _, errs = sample(rows[s], states, [None] * len(states))
        for i, t in enumerate(toks):
            out[i].append(t)
    return out


def test_a_seeded_request_draws_the_same_tokens_in_any_batch(path: str) -> None:
    g = torch.Generator().manual_seed(2)
    steps = 30
    mine = torch.randn(steps, V, generator=g) * 3
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=1234)
    alone = _run([SampleState.create(params, [1])], mine.unsqueeze(1), steps)[0]
    for pos in (0, 2, 4):
        others = torch.randn(steps, 5, V, generator=g) * 3
        others[:, pos] = mine
        states = [SampleState.create(SamplingParams(**KNOBS[k]), [1]) for k in range(5)]
        states[pos] = SampleState.create(params, [1])
        assert _run(states, others, steps)[pos] == alone


def test_one_row_with_no_finite_token_fails_alone(path: str) -> None:
    vocab = 64
    bias = {t: -float("inf") for t in range(vocab)}
    states = [SampleState.create(SamplingParams(temperature=1.0, seed=5), [1]),
              SampleState.create(SamplingParams(temperature=1.0, logit_bias=bias), [1]),
              SampleState.create(SamplingParams(temperature=0.0), [1])]
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(3))
    toks, _, errs = sample(logits, states, [None] * 3)
    assert toks[0] is not None and toks[2] == int(logits[2].argmax())
    assert toks[1] is None and errs[1] is not None and errs[1][1] == 400, errs
