"""choose_layout under a neighbour's load (#47): a burst of other work on the machine while the
layouts are timed at load must not decide which layout a weight shape keeps for the life of the
process. The GEMMs and the clock are stood in for (each call advances a fake clock by its
layout's cost, times 5 while a burst is on), so the mechanism is tested, not the machine."""

from __future__ import annotations

import pytest
import torch

from pdcore.engine import native
from pdcore.engine.cpu_features import LAYOUT_ENV
from pdcore.engine.model import layers

SLOW = 5.0  # a call during a burst costs this many times its quiet cost
PANELS_MS = {layers.DECODE_ROWS: 1.0, layers.PREFILL_ROWS: 10.0}


def _decide(monkeypatch: pytest.MonkeyPatch, onednn_factor: float, slow) -> tuple[str, list]:
    """The layout pack_weight keeps for a float32 [64, 32] weight when oneDNN's GEMM costs
    `onednn_factor` times the panels' and `slow(i, name)` says whether call i (of all timed
    GEMM calls, in order; `name` the layout) falls in a burst. Returns (layout, calls)."""
    if not native.panel_gemm():
        pytest.skip(f"the panel GEMM does not serve here ({native.status()})")
    monkeypatch.setenv(layers.PACKED_GEMM_ENV, "1")
    monkeypatch.setenv(LAYOUT_ENV, "auto")
    monkeypatch.setattr(layers, "_layout_choice", {})
    monkeypatch.setattr(layers, "STREAM_BYTES", 1)  # one copy: one GEMM call per timed run
    now = [0.0]
    calls: list[str] = []

    def fake_linear(x, weight, bias=None, packed=None):
        name = "panels" if packed.layout == torch.strided else "onednn"
        ms = PANELS_MS[x.shape[0]] * (onednn_factor if name == "onednn" else 1.0)
        now[0] += ms * (SLOW if slow(len(calls), name) else 1.0) / 1e3
        calls.append(name)

    monkeypatch.setattr(layers, "_clock", lambda: now[0])
    monkeypatch.setattr(layers, "linear", fake_linear)
    packed = layers.pack_weight(torch.randn(64, 32))
    return ("panels" if packed.layout == torch.strided else "onednn"), calls


def test_the_layouts_are_timed_interleaved(monkeypatch: pytest.MonkeyPatch) -> None:
    """Per row count: a warm call of each layout, then LAYOUT_REPS pairs, A B then B A."""
    _, calls = _decide(monkeypatch, 1.0, lambda i, name: False)
    reps = [("panels", "onednn") if i % 2 == 0 else ("onednn", "panels")
            for i in range(layers.LAYOUT_REPS)]
    one = ["panels", "onednn"] + [n for pair in reps for n in pair]
    assert calls == one + one  # decode rows, then prefill rows


@pytest.mark.parametrize("burst", [3, 1 + layers.LAYOUT_REPS])
@pytest.mark.parametrize("onednn_factor, want", [(1.05, "panels"), (0.7, "onednn")])
def test_a_burst_of_load_does_not_flip_the_layout(onednn_factor: float, want: str, burst: int,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A burst of `burst` consecutive slow calls (up to as many as one layout's whole timing,
    warm call included), wherever it falls, leaves the quiet decision: panels when oneDNN is
    5% dearer, oneDNN when it is 30% cheaper every rep. (Timed one layout after the other, as
    before #47, a burst over all of the panels' reps made oneDNN look 5x cheaper.)"""
    quiet, calls = _decide(monkeypatch, onednn_factor, lambda i, name: False)
    assert quiet == want
    for start in range(len(calls) - burst + 1):
        got, _ = _decide(monkeypatch, onednn_factor, lambda i, name: start <= i < start + burst)
        assert got == want, f"a burst over calls {start}..{start + burst - 1} flipped it to {got}"


def test_every_other_slow_panels_call_keeps_panels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every other panels call 5x slower (most of the pairs then favour oneDNN): the layouts'
    best reps still say oneDNN is 5% dearer, so panels stay: oneDNN needs both to agree."""
    n = {"panels": 0}

    def slow(i: int, name: str) -> bool:
        if name != "panels":
            return False
        n["panels"] += 1
        return n["panels"] % 2 == 0

    assert _decide(monkeypatch, 1.05, slow)[0] == "panels"


def test_a_near_tie_keeps_panels(monkeypatch: pytest.MonkeyPatch) -> None:
    """oneDNN 8% cheaper every rep is inside ONEDNN_MARGIN (load noise, not a win): panels."""
    assert layers.ONEDNN_MARGIN > 0.08
    assert _decide(monkeypatch, 0.92, lambda i, name: False)[0] == "panels"
