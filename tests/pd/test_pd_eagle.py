"""EAGLE speculative decoding through PD (#33 item 3).

P runs the target's prefill and the draft head over the prompt (its K/V at the target's own
slots); the head's one-layer pool travels as one more KV layer with the target's pages, through
the same backend, counted in the transfer metrics; D continues speculating from the first token:
the chain start P's head made (the first draft token and the head's output vector) crosses in
the aux row, so D's very first decode step drafts.

- 1P1D over tcp and over shm (segment mode), EAGLE on both: greedy output equals a unified
  engine's without speculation, token for token, and D verified drafts; over shm the draft K
  rows P computed for a prompt (one per position, the last paired with the first token) are
  read back from both servers' segments: D holds every one of them; every request's chain
  start was sent by P and adopted by D (none dropped);
- with max_new_tokens=3 a request verifies drafts on D's first decode step (spec_verify_ct 1:
  without the chain start that step has no drafts and the next has no room for one);
- P's transfer bytes with EAGLE exceed a plain P's for the same prompts by exactly the draft
  layer's share (one more layer of K and V per page) plus one chain start vector per request
  (hidden x 4 bytes); a plain P moves nothing extra;
- a mixed fleet (EAGLE on D only, or on P only) is refused at pairing with words naming
  --speculative-algorithm, and neither side keeps a page;
- units: the draft layer's pages move at the target's page indices (KVCache.transfer layout
  through the default planner), and a draft pool of another geometry is refused at start.

Servers are paired by hand (the router's fan-out: P's call in a thread, D's in the test), so one
set of servers covers every pairing. PDSERVE_SPEC_GATE=0 verifies every draft.
"""

from __future__ import annotations

import ctypes
import json
import os
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from draft_pd import (
    PAGE,
    Prefill,
    at_rest,
    decode,
    draft_rows,
    load,
    pair,
    server,
)

from pdcore.builtin.planner import DefaultPlanner
from pdcore.config import ServerArgs
from pdcore.messages.io import SamplingParams
from pdcore.engine.kv.cache import KVCache
from pdcore.engine.model.tokenizer import default_model_file
from pdcore.errors import ConfigError
from pdcore.runtime.llm_engine import LLMEngine
from pdcore.testing.processes import ServerProcess, trust_prefill
from pdcore.testing.tiny_models import make_eagle_head, make_tiny_model

HIDDEN, HEADS, KV_HEADS, LAYERS = 64, 4, 2, 2
NEW = 24
ROW = KV_HEADS * (HIDDEN // HEADS)  # a token's K in the draft pool, float32 values


def make_head(path: str, vocab: int, seed: int = 1) -> str:
    """A random EAGLE-1 head folder of the tiny target's attention shape."""
    return make_eagle_head(path, vocab=vocab, hidden=HIDDEN, heads=HEADS, kv_heads=KV_HEADS,
                           seed=seed)


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (23, 9, 41, 30)]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> Any:
    root = tmp_path_factory.mktemp("pd_eagle")
    model = make_tiny_model(str(root / "m"), seed=13, layers=LAYERS, hidden=HIDDEN, heads=HEADS,
                            kv_heads=KV_HEADS, tokenizer_from=default_model_file())
    with open(os.path.join(model, "config.json"), encoding="utf-8") as f:
        vocab = json.load(f)["vocab_size"]
    head = make_head(str(root / "h"), vocab)
    eagle = ("--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", head,
             "--speculative-num-steps", "3")
    common = ("--model-path", model)
    made: dict[str, Any] = {}
    try:
        for backend in ("tcp", "shm"):
            made[f"p-eagle-{backend}"] = Prefill(backend, *common, *eagle)
            made[f"d-eagle-{backend}"] = decode(backend, *common, *eagle)
        made["p-plain-tcp"] = Prefill("tcp", *common)
        made["d-plain-tcp"] = decode("tcp", *common)
        for s in made.values():
            server(s).wait_healthy(300)
        ports = [p.port for p in made.values() if isinstance(p, Prefill)]
        for s in made.values():
            if isinstance(s, ServerProcess):
                trust_prefill(s.url, *ports)
        eng = LLMEngine(ServerArgs(model_path=model, max_total_tokens=2048, page_size=PAGE))
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


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_greedy_with_eagle_through_pd_equals_unified(fleet, backend) -> None:
    p, d = fleet[f"p-eagle-{backend}"], fleet[f"d-eagle-{backend}"]
    before = load(d)
    for i, (ids, want) in enumerate(zip(fleet["prompts"], fleet["ref"])):
        if backend == "shm" and i == 0:  # the draft K/V that P computed are the ones D holds
            p_before = draft_rows(p.server, ROW)
            r, pr = pair(p, d, ids, NEW)
            new = draft_rows(p.server, ROW) - p_before
            assert len(new) == len(ids), (len(new), len(ids))  # every prompt position
            assert new <= draft_rows(d, ROW)
        else:
            r, pr = pair(p, d, ids, NEW)
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == want
        assert isinstance(pr, httpx.Response) and pr.status_code == 200, pr
    after, p_load = load(d), load(p.server)
    # D drafted (its chains read the draft K/V P sent, from the chain start P sent)
    assert after["spec_verifies_total"] > before.get("spec_verifies_total", 0), after
    assert after["spec_draft_failures_total"] == 0, after
    n = len(fleet["prompts"])
    assert after["disagg_chain_starts_received_total"] - before.get(
        "disagg_chain_starts_received_total", 0) == n, after
    assert after["disagg_chain_starts_dropped_total"] == 0, after
    # P ran the draft head over every prompt and drafted nothing itself
    assert p_load["spec_draft_passes_total"] > 0 and p_load["spec_verifies_total"] == 0, p_load
    assert p_load["disagg_chain_starts_sent_total"] >= n, p_load
    assert p_load["disagg_chain_starts_missing_total"] == 0, p_load
    at_rest(p.server, d)


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_first_decode_step_drafts_from_the_chain_start(fleet, backend) -> None:
    """Three tokens: P's, then D's first decode step verifies [first token, one draft]; without
    P's chain start it could not draft, and the step after has no room left for a draft."""
    p, d = fleet[f"p-eagle-{backend}"], fleet[f"d-eagle-{backend}"]
    for ids, want in zip(fleet["prompts"], fleet["ref"]):
        r, pr = pair(p, d, ids, 3)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["output_ids"] == want[:3]
        assert body["meta_info"]["spec_verify_ct"] >= 1, body["meta_info"]
        assert isinstance(pr, httpx.Response) and pr.status_code == 200, pr
    at_rest(p.server, d)


def test_transfer_bytes_count_the_draft_layer(fleet) -> None:
    """The same prompts through an EAGLE pair and a plain pair: P's KV bytes differ by one
    layer of K and V per page sent and one chain start vector per request, exactly."""
    pe, de = fleet["p-eagle-tcp"], fleet["d-eagle-tcp"]
    pn, dn = fleet["p-plain-tcp"], fleet["d-plain-tcp"]
    moved = {}
    for name, p, d in (("eagle", pe, de), ("plain", pn, dn)):
        before = load(p.server).get("kv_bytes", 0)
        for ids, want in zip(fleet["prompts"], fleet["ref"]):
            r, _ = pair(p, d, ids, NEW)
            assert r.status_code == 200 and r.json()["output_ids"] == want, (name, r.text)
        at_rest(p.server, d)
        moved[name] = load(p.server)["kv_bytes"] - before
    pages = sum(-(-len(ids) // PAGE) for ids in fleet["prompts"])
    layer = pages * PAGE * KV_HEADS * (HIDDEN // HEADS) * 4 * 2  # one layer's K and V, float32
    assert moved["plain"] == layer * LAYERS, moved
    chain = len(fleet["prompts"]) * HIDDEN * 4  # the head's output vector, float32
    assert moved["eagle"] == layer * (LAYERS + 1) + chain, moved


@pytest.mark.parametrize("p_name,d_name,words", [
    ("p-plain-tcp", "d-eagle-tcp", "prefill 127.0.0.1:{port} runs no draft head"),
    ("p-eagle-tcp", "d-plain-tcp", "prefill 127.0.0.1:{port} runs a speculative draft head")])
def test_mixed_fleet_is_refused_at_pairing(fleet, p_name, d_name, words) -> None:
    p, d = fleet[p_name], fleet[d_name]
    ids = fleet["prompts"][0]
    r, pr = pair(p, d, ids, NEW)
    assert r.status_code >= 400, r.text
    assert words.format(port=p.port) in r.text and "--speculative-algorithm" in r.text, r.text
    assert isinstance(pr, httpx.Response) and pr.status_code >= 400, pr
    assert "--speculative-algorithm" in pr.text, pr.text
    at_rest(p.server, d)
    assert load(d)["kv_pairing_refused"] >= 1
    # both still serve their own kind of peer
    p_ok = fleet["p-eagle-tcp" if d_name == "d-eagle-tcp" else "p-plain-tcp"]
    r, _ = pair(p_ok, d, ids, NEW)
    assert r.status_code == 200 and r.json()["output_ids"] == fleet["ref"][0], r.text
    at_rest(p_ok.server, d)


# -- units --------------------------------------------------------------------------------------
class _Pool:
    name = "test"

    def __init__(self) -> None:
        self.bufs: list[Any] = []

    def allocate(self, label, shape, dtype):
        from pdcore.interfaces.memory import Buffer
        from pdcore.interfaces.transfer import MemoryRegion

        t = torch.zeros(shape, dtype=dtype)
        self.bufs.append(t)
        return Buffer(t, MemoryRegion(t.data_ptr(), t.numel() * t.element_size(), name=label))

    def close(self) -> None:
        self.bufs.clear()


def _kv(pages: int = 8) -> KVCache:
    return KVCache(_Pool(), LAYERS, pages, PAGE, KV_HEADS, 16, dtype=torch.float32)


def test_draft_layer_moves_at_the_target_page_indices() -> None:
    src, dst = _kv(), _kv()
    for kv in (src, dst):  # pools one scratch page longer than the target's, as the head's
        for label in ("draft_k", "draft_v"):
            kv.draft_buffer(label, (9, PAGE, KV_HEADS, 16), torch.float32)
    g = torch.Generator().manual_seed(0)
    for k, v in src.transfer_layers:
        k.copy_(torch.randn(k.shape, generator=g))
        v.copy_(torch.randn(v.shape, generator=g))
    a, b = src.layout(), dst.layout()
    assert (a.num_layers, a.draft_layers, len(src.regions())) == (LAYERS + 1, 1, 2 * LAYERS + 2)
    s_pages, d_pages = np.array([1, 2, 5]), np.array([6, 7, 0])
    batch = DefaultPlanner().plan(a, b, s_pages, d_pages)
    for s, d, n in zip(batch.src, batch.dst, batch.length):
        ctypes.memmove(int(d), int(s), int(n))
    for (sk, sv), (dk, dv) in zip(src.transfer_layers, dst.transfer_layers):
        assert torch.equal(dk[d_pages], sk[s_pages]) and torch.equal(dv[d_pages], sv[s_pages])
    assert batch.nbytes == 3 * a.page_bytes


def test_draft_pool_of_another_geometry_is_refused() -> None:
    kv = _kv()
    with pytest.raises(ConfigError, match="same page geometry"):
        kv.draft_buffer("draft_k", (9, PAGE, KV_HEADS, 32), torch.float32)
    with pytest.raises(ConfigError, match="same page geometry"):
        kv.draft_buffer("draft_k", (9, PAGE, KV_HEADS, 16), torch.bfloat16)
    assert kv.layout().draft_layers == 0


def test_eagle_in_pd_mode_validates() -> None:
    for mode in ("prefill", "decode"):
        ServerArgs(speculative_algorithm="EAGLE", speculative_draft_model_path="/x",
                   disaggregation_mode=mode).validate()
    ServerArgs(speculative_algorithm="EAGLE", speculative_draft_model_path="/x",
               disaggregation_mode="decode", tp_size=2).validate()  # test_pd_spec_tp.py
    ServerArgs(speculative_algorithm="EAGLE", speculative_draft_model_path="/x",
               disaggregation_mode="decode", tp_size=2, dp_size=2,
               enable_dp_attention=True).validate()  # test_pd_spec_dp.py
    with pytest.raises(ConfigError, match="topk 2"):
        ServerArgs(speculative_algorithm="EAGLE", speculative_draft_model_path="/x",
                   disaggregation_mode="prefill", speculative_eagle_topk=2).validate()
