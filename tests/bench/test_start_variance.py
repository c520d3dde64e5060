"""bench/start_variance.py's analysis: the two-way fit separates a start's own speed from the
host's drift (slot effects), and the pair ratios read each phase's newer over older start."""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import start_variance as sv  # noqa: E402


def chain(effects: list[float], drift: list[float], rounds: int) -> list[tuple[int, int, float]]:
    """Samples as the bench takes them: starts k and k + 1 measured in each slot of phase k,
    t = 40 ms * start factor * the slot's drift factor."""
    out, slot = [], 0
    for k in range(len(effects) - 1):
        for _ in range(rounds):
            d = drift[slot % len(drift)]
            out += [(j, slot, 40.0 * (1 + effects[j]) * d) for j in (k, k + 1)]
            slot += 1
    return out


def test_fit_recovers_start_effects_under_drift() -> None:
    effects = [0.0, 0.25, 0.0, -0.1, 0.0]  # start 1 a quarter slower, start 3 10% faster
    drift = [1.0, 1.4, 0.8, 1.2, 0.9, 1.6, 1.1]  # the host, far larger than the effects
    f = sv.fit(chain(effects, drift, rounds=3), len(effects))
    base = math.exp(sum(math.log(1 + e) for e in effects) / len(effects))
    want = [((1 + e) / base - 1) * 100 for e in effects]
    # effects are stored rounded to 0.01 %
    assert max(abs(g - w) for g, w in zip(f["start_effect_pct"], want, strict=True)) < 0.01
    assert f["residual_pct"] < 1e-6
    ratios = sv.pair_ratios(chain(effects, drift, rounds=3))
    assert [r["starts"] for r in ratios] == [[0, 1], [1, 2], [2, 3], [3, 4]]
    assert [round(r["newer_over_older"], 3) for r in ratios] == [1.25, 0.8, 0.9, round(1 / 0.9, 3)]


def test_fit_without_start_effects_puts_the_noise_in_the_residual() -> None:
    samples = chain([0.0] * 4, [1.0], rounds=4)
    noisy = [(k, s, t * (1.1 if (k + s) % 2 else 0.9)) for k, s, t in samples]
    f = sv.fit(noisy, 4)
    assert f["residual_pct"] > 5
    assert f["start_effect_range_pct"] < f["residual_pct"]
