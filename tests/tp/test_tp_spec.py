"""Speculative decoding (NGRAM) on a TP 2 decode server behind a TP 1 prefill server (#33):
greedy output equals the unified TP 1 engine's without speculation, token for token. Rank 0
verifies and hands the accepted tokens to rank 1; both ranks draft alike (the drafts come from
the request's tokens, the cost gate's ratio travels in the step header). Each prompt is sent
twice, so the second time D drafts from the first answer (its cross-request n-gram cache) and
drafts are accepted, not only proposed."""

from __future__ import annotations

import pytest
from tp_helpers import NEW, Fleet, pd_generate

from pdcore.testing.pages import load_at_rest

pytestmark = pytest.mark.heavy  # TP process trees

SPEC = ("--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "5")


def test_tp2_decode_speculates_and_equals_unified(tiny_tp_model, prompts_and_unified) -> None:
    prompts, unified = prompts_and_unified
    fleet = Fleet("tcp", str(tiny_tp_model), {
        "p1": ("prefill", 1, {}),
        "d2": ("decode", 2, {"PDSERVE_SPEC_GATE": "0"}, SPEC)}).start()
    try:
        for i, (ids, want) in enumerate(zip(prompts[:4], unified[:4])):
            for _ in range(2):
                status, out = pd_generate(fleet, "p1", "d2", ids, NEW)
                assert status == 200, f"prompt {i}: {out}"
                assert out["output_ids"] == want, f"prompt {i} differs from unified TP 1"
        load = fleet.load("d2")
        assert load["spec_verifies_total"] > 0 and load["spec_accepted_tokens_total"] > 0, load
        assert load_at_rest(load), load
    finally:
        fleet.stop()
