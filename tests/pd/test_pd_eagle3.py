"""EAGLE3 speculative decoding through PD (#33), 1P1D over tcp.

Both sides capture the target's three layers: P runs the EAGLE-3 head over the prompt (from the
captured states; its K/V at the prompt's slots) and sends its pool as one more KV layer and its
chain start (the first draft, a target id, and the head's output before its norm) in the aux
row; D continues from it, capturing on its own steps for the head's later passes.

- greedy output equals a unified engine's without speculation, token for token; D verified
  drafts, adopted every chain start P sent, and none was dropped; P ran the head and drafted
  nothing itself;
- with max_new_tokens=3 D's first decode step verifies a draft (the chain start's).
"""

from __future__ import annotations

import json
import os
from typing import Any

import httpx
import pytest
import torch
from draft_pd import Prefill, at_rest, decode, load, pair, server

from pdcore.config import ServerArgs
from pdcore.messages.io import SamplingParams
from pdcore.engine.model.tokenizer import default_model_file
from pdcore.runtime.llm_engine import LLMEngine
from pdcore.testing.processes import trust_prefill
from pdcore.testing.tiny_models import make_eagle3_head, make_tiny_model

HIDDEN, HEADS, KV_HEADS, LAYERS = 64, 4, 2, 8
NEW = 20


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (23, 9, 41)]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> Any:
    root = tmp_path_factory.mktemp("pd_eagle3")
    model = make_tiny_model(str(root / "m"), seed=13, layers=LAYERS, hidden=HIDDEN, heads=HEADS,
                            kv_heads=KV_HEADS, tokenizer_from=default_model_file())
    with open(os.path.join(model, "config.json"), encoding="utf-8") as f:
        vocab = json.load(f)["vocab_size"]
    head = make_eagle3_head(str(root / "h"), vocab=vocab, hidden=HIDDEN, heads=HEADS,
                            kv_heads=KV_HEADS, seed=1, draft_vocab=1024)
    flags = ("--model-path", model, "--speculative-algorithm", "EAGLE3",
             "--speculative-draft-model-path", head, "--speculative-num-steps", "3")
    made: dict[str, Any] = {}
    try:
        made["p"] = Prefill("tcp", *flags)
        made["d"] = decode("tcp", *flags)
        for s in made.values():
            server(s).wait_healthy(300)
        trust_prefill(made["d"].url, made["p"].port)
        eng = LLMEngine(ServerArgs(model_path=model, max_total_tokens=2048, page_size=4))
        try:
            prompts = _prompts(vocab)
            ref = eng.generate(prompts, SamplingParams(max_new_tokens=NEW, temperature=0.0,
                                                       ignore_eos=True))
        finally:
            eng.close()
        yield {**made, "prompts": prompts, "ref": [r["output_ids"] for r in ref]}
    finally:
        for s in made.values():
            server(s).stop()


def test_greedy_with_eagle3_through_pd_equals_unified(fleet) -> None:
    p, d = fleet["p"], fleet["d"]
    before = load(d)
    for ids, want in zip(fleet["prompts"], fleet["ref"]):
        r, pr = pair(p, d, ids, NEW)
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == want
        assert isinstance(pr, httpx.Response) and pr.status_code == 200, pr
    after, p_load = load(d), load(p.server)
    assert after["spec_verifies_total"] > before.get("spec_verifies_total", 0), after
    assert after["spec_draft_failures_total"] == 0, after
    n = len(fleet["prompts"])
    assert after["disagg_chain_starts_received_total"] - before.get(
        "disagg_chain_starts_received_total", 0) == n, after
    assert after["disagg_chain_starts_dropped_total"] == 0, after
    assert p_load["spec_draft_passes_total"] > 0 and p_load["spec_verifies_total"] == 0, p_load
    assert p_load["disagg_chain_starts_missing_total"] == 0, p_load
    at_rest(p.server, d)


def test_first_decode_step_drafts_from_the_chain_start(fleet) -> None:
    p, d = fleet["p"], fleet["d"]
    for ids, want in zip(fleet["prompts"], fleet["ref"]):
        r, pr = pair(p, d, ids, 3)
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == want[:3]
        assert r.json()["meta_info"]["spec_verify_ct"] >= 1, r.json()["meta_info"]
        assert isinstance(pr, httpx.Response) and pr.status_code == 200, pr
    at_rest(p.server, d)
