"""NEXTN (a DeepSeek-V3 checkpoint's own MTP layer) speculative decoding through PD (#33).

The MTP layer is an MLA layer: its pool is one latent buffer shaped like the target's MLA
pool, so in PD mode it is allocated in the KV pool's memory and travels as one more MLA layer
(`KVLayout.draft_layers`, its V base its K base) at the target's page indices. P runs the MTP
layer over the prompt; its chain start (the first draft token and the layer's output vector)
crosses in the aux row, so D drafts from its first decode step.

- 1P1D over tcp and over shm (segment mode), NEXTN on both: greedy output equals a unified
  engine's without speculation, token for token, and D verified drafts; over shm the latent
  rows P's MTP layer computed for a prompt (one per position) are read back from both servers'
  segments: D holds every one of them; D adopted every request's chain start; with
  max_new_tokens=3 D's first decode step verifies a draft;
- P's transfer bytes with NEXTN are those of a plain P times (layers + 1) / layers: one more
  latent per token, once (not as K and V), plus one chain start vector per request;
- a mixed fleet (NEXTN on D only, or on P only) is refused at pairing naming
  --speculative-algorithm, and neither side keeps a page;
- units: the latent draft layer moves at the target's page indices through the default
  planner, copied once; a K/V (non-latent) draft pool beside an MLA pool is refused; NEXTN
  validates in PD mode with TP 1 and 2 (TP 2 pairs: test_pd_spec_tp.py) and DP attention
  (test_pd_spec_dp.py), refuses topk > 1 there.

Servers are paired by hand (the router's fan-out), as in test_pd_eagle.py. PDSERVE_SPEC_GATE=0
verifies every draft.
"""

from __future__ import annotations

import ctypes
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
    segments,
    server,
)

from pdcore.builtin.planner import DefaultPlanner
from pdcore.config import ServerArgs
from pdcore.messages.io import SamplingParams
from pdcore.engine.kv.cache import KVCache
from pdcore.engine.model.tokenizer import default_model_file
from pdcore.errors import ConfigError
from pdcore.interfaces.memory import PoolContext
from pdcore.plugins.host import memory_pools
from pdcore.runtime.llm_engine import LLMEngine
from pdcore.testing.processes import ServerProcess, trust_prefill
from pdcore.testing.tiny_models import add_mtp_layer, make_tiny_model

LAYERS, NEW = 2, 16
HIDDEN = 64  # the tiny DeepSeek's hidden size (make_tiny_model's default)
LATENT = 32 + 8  # tiny DeepSeek: kv_lora_rank + rope dim
NEXTN = ("--speculative-algorithm", "NEXTN", "--speculative-num-steps", "3",
         "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> Any:
    root = tmp_path_factory.mktemp("pd_nextn")
    model = add_mtp_layer(make_tiny_model(str(root / "m"), arch="deepseek_v3", layers=LAYERS,
                                          seed=13, tokenizer_from=default_model_file()), seed=1)
    common = ("--model-path", model)
    made: dict[str, Any] = {}
    try:
        for backend in ("tcp", "shm"):
            made[f"p-nextn-{backend}"] = Prefill(backend, *common, *NEXTN)
            made[f"d-nextn-{backend}"] = decode(backend, *common, *NEXTN)
        made["p-plain-tcp"] = Prefill("tcp", *common)
        made["d-plain-tcp"] = decode("tcp", *common)
        for s in made.values():
            server(s).wait_healthy(300)
        ports = [p.port for p in made.values() if isinstance(p, Prefill)]
        for s in made.values():
            if isinstance(s, ServerProcess):
                trust_prefill(s.url, *ports)
        g = torch.Generator().manual_seed(4)
        prompts = [torch.randint(100, 40000, (n,), generator=g).tolist() for n in (23, 9, 41)]
        eng = LLMEngine(ServerArgs(model_path=model, max_total_tokens=2048, page_size=PAGE))
        try:
            ref = eng.generate(prompts, SamplingParams(max_new_tokens=NEW, temperature=0.0,
                                                       ignore_eos=True))
        finally:
            eng.close()
        yield {**made, "prompts": prompts, "ref": [r["output_ids"] for r in ref]}
    finally:
        for s in made.values():
            server(s).stop()


def _latent_rows(s: ServerProcess) -> set[bytes]:
    """The non-zero latent rows of a shm server's draft pool (segment ..._draft-k: NEXTN's one
    latent buffer, no ..._draft-v)."""
    assert not [n for n in segments(s) if n.endswith("_draft-v")], segments(s)
    return draft_rows(s, LATENT)


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_greedy_with_nextn_through_pd_equals_unified(fleet, backend) -> None:
    p, d = fleet[f"p-nextn-{backend}"], fleet[f"d-nextn-{backend}"]
    before = load(d)
    for i, (ids, want) in enumerate(zip(fleet["prompts"], fleet["ref"])):
        if backend == "shm" and i == 0:  # the latent rows P's MTP layer wrote are D's
            p_before = _latent_rows(p.server)
            r, pr = pair(p, d, ids, NEW)
            new = _latent_rows(p.server) - p_before
            assert len(new) == len(ids), (len(new), len(ids))
            assert new <= _latent_rows(d)
        else:
            r, pr = pair(p, d, ids, NEW)
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == want, (i, r.json()["output_ids"], want)
        assert isinstance(pr, httpx.Response) and pr.status_code == 200, pr
    after, p_load = load(d), load(p.server)
    assert after["spec_verifies_total"] > before.get("spec_verifies_total", 0), after
    assert after["spec_draft_failures_total"] == 0, after
    assert after["disagg_chain_starts_received_total"] - before.get(
        "disagg_chain_starts_received_total", 0) == len(fleet["prompts"]), after
    assert after["disagg_chain_starts_dropped_total"] == 0, after
    assert p_load["spec_draft_passes_total"] > 0 and p_load["spec_verifies_total"] == 0, p_load
    at_rest(p.server, d)
    for ids, want in zip(fleet["prompts"], fleet["ref"]):  # D's first decode step drafts
        r, _ = pair(p, d, ids, 3)
        assert r.status_code == 200 and r.json()["output_ids"] == want[:3], r.text
        assert r.json()["meta_info"]["spec_verify_ct"] >= 1, r.json()["meta_info"]
    at_rest(p.server, d)


def test_transfer_bytes_count_the_latent_draft_layer(fleet) -> None:
    moved = {}
    for name in ("nextn", "plain"):
        p, d = fleet[f"p-{name}-tcp"], fleet[f"d-{name}-tcp"]
        before = load(p.server).get("kv_bytes", 0)
        for ids, want in zip(fleet["prompts"], fleet["ref"]):
            r, _ = pair(p, d, ids, NEW)
            assert r.status_code == 200 and r.json()["output_ids"] == want, (name, r.text)
        at_rest(p.server, d)
        moved[name] = load(p.server)["kv_bytes"] - before
    pages = sum(-(-len(ids) // PAGE) for ids in fleet["prompts"])
    layer = pages * PAGE * LATENT * 4  # one MLA layer: one float32 latent per token
    assert moved["plain"] == layer * LAYERS, moved
    chain = len(fleet["prompts"]) * HIDDEN * 4  # the MTP layer's output vector, float32
    assert moved["nextn"] == layer * (LAYERS + 1) + chain, moved


@pytest.mark.parametrize("p_name,d_name,words", [
    ("p-plain-tcp", "d-nextn-tcp", "prefill 127.0.0.1:{port} runs no draft head"),
    ("p-nextn-tcp", "d-plain-tcp", "prefill 127.0.0.1:{port} runs a speculative draft head")])
def test_mixed_fleet_is_refused_at_pairing(fleet, p_name, d_name, words) -> None:
    p, d = fleet[p_name], fleet[d_name]
    ids = fleet["prompts"][1]
    r, pr = pair(p, d, ids, NEW)
    assert r.status_code >= 400, r.text
    assert words.format(port=p.port) in r.text and "--speculative-algorithm" in r.text, r.text
    assert isinstance(pr, httpx.Response) and pr.status_code >= 400, pr
    assert "--speculative-algorithm" in pr.text, pr.text
    at_rest(p.server, d)
    assert load(d)["kv_pairing_refused"] >= 1
    p_ok = fleet["p-nextn-tcp" if d_name == "d-nextn-tcp" else "p-plain-tcp"]
    r, _ = pair(p_ok, d, ids, NEW)
    assert r.status_code == 200 and r.json()["output_ids"] == fleet["ref"][1], r.text
    at_rest(p_ok.server, d)


# -- units --------------------------------------------------------------------------------------
def _mla(pages: int = 8) -> KVCache:
    pool = memory_pools().create("torch", PoolContext(rank=0))
    return KVCache(pool, LAYERS, pages, PAGE, 1, LATENT, dtype=torch.float32, tp_rank=0, tp_size=1,
                   total_kv_heads=1, is_mla=True)


def test_latent_draft_layer_moves_once_at_the_target_page_indices() -> None:
    src, dst = _mla(), _mla()
    for kv in (src, dst):  # one scratch page past the target's, as the head's pool has
        t = kv.draft_buffer("draft_k", (9, PAGE, 1, LATENT), torch.float32, latent=True)
        assert kv.transfer_layers[-1][0] is t and kv.transfer_layers[-1][1] is t
    g = torch.Generator().manual_seed(0)
    for k, _ in src.transfer_layers:
        k.copy_(torch.randn(k.shape, generator=g))
    a, b = src.layout(), dst.layout()
    assert (a.num_layers, a.draft_layers, len(src.regions())) == (LAYERS + 1, 1, LAYERS + 1)
    assert a.is_mla and a.v_bases == a.k_bases
    s_pages, d_pages = np.array([1, 2, 5]), np.array([6, 7, 0])
    batch = DefaultPlanner().plan(a, b, s_pages, d_pages)
    for s, d, n in zip(batch.src, batch.dst, batch.length):
        ctypes.memmove(int(d), int(s), int(n))
    for (sk, _), (dk, _) in zip(src.transfer_layers, dst.transfer_layers):
        assert torch.equal(dk[d_pages], sk[s_pages])
    assert batch.nbytes == 3 * a.page_bytes == 3 * (LAYERS + 1) * PAGE * LATENT * 4


def test_a_kv_draft_pool_beside_an_mla_pool_is_refused() -> None:
    kv = _mla()
    with pytest.raises(ConfigError, match="same page geometry"):
        kv.draft_buffer("draft_k", (9, PAGE, 1, LATENT), torch.float32)  # not latent
    with pytest.raises(ConfigError, match="same page geometry"):
        kv.draft_buffer("draft_k", (9, PAGE, 1, LATENT + 8), torch.float32, latent=True)
    assert kv.layout().draft_layers == 0


def test_nextn_in_pd_mode_validates() -> None:
    for mode in ("prefill", "decode"):
        args = ServerArgs(speculative_algorithm="NEXTN", disaggregation_mode=mode)
        args.validate()
        assert (args.speculative_num_steps, args.speculative_num_draft_tokens) == (3, 4)
        ServerArgs(speculative_algorithm="NEXTN", disaggregation_mode=mode,
                   tp_size=2).validate()
        ServerArgs(speculative_algorithm="NEXTN", disaggregation_mode=mode, tp_size=2,
                   dp_size=2, enable_dp_attention=True).validate()  # test_pd_spec_dp.py
        with pytest.raises(ConfigError, match="topk 2"):
            ServerArgs(speculative_algorithm="NEXTN", disaggregation_mode=mode,
                       speculative_eagle_topk=2).validate()
