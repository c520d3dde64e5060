"""Multi-layer MTP (`--enable-multi-layer-eagle`, a MiMo's own N MTP layers) through PD (#33).

Each MTP layer has its own K/V pool; in PD mode every one is allocated in the KV pool's memory
and travels as one more KV layer (`KVLayout.draft_layers` N) at the target's page indices. P
runs the layers over the prompt (each as far as the known tokens reach) and its chain start
crosses in the aux row, as EAGLE's does.

- 1P1D over tcp, multi-layer EAGLE on both: greedy output equals a unified engine's without
  speculation, token for token; D verified drafts and adopted every chain start; P's transfer
  bytes are a plain transfer's times (layers + N) / layers plus one chain start vector per
  request;
- unit: the drafter's N pools are N draft layers of the KV cache's layout, each its own buffer.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from draft_pd import PAGE, Prefill, at_rest, decode, load, pair, server

from pdcore.config import ServerArgs
from pdcore.messages.io import SamplingParams
from pdcore.engine.kv.blocks import BlockManager
from pdcore.engine.kv.cache import KVCache
from pdcore.engine.model.tokenizer import default_model_file
from pdcore.engine.sched.mtp_chain import MultiLayerDrafter
from pdcore.interfaces.memory import PoolContext
from pdcore.plugins.host import memory_pools
from pdcore.runtime.llm_engine import LLMEngine
from pdcore.testing.processes import ServerProcess, trust_prefill
from pdcore.testing.tiny_models import make_tiny_mimo

LAYERS, MTP, NEW = 2, 3, 16
HIDDEN, KV_HEADS, HEAD_DIM = 64, 2, 16  # make_tiny_model's defaults (64 / 4 heads)
MULTI = ("--speculative-algorithm", "EAGLE", "--enable-multi-layer-eagle",
         "--speculative-num-steps", "4", "--speculative-eagle-topk", "1",
         "--speculative-num-draft-tokens", "5")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> Any:
    root = tmp_path_factory.mktemp("pd_mimo")
    model = make_tiny_mimo(str(root / "m"), mtp_layers=MTP, seed=13,
                           tokenizer_from=default_model_file())
    made: dict[str, Any] = {}
    try:
        made["p"] = Prefill("tcp", "--model-path", model, *MULTI)
        made["d"] = decode("tcp", "--model-path", model, *MULTI)
        for s in made.values():
            server(s).wait_healthy(300)
        trust_prefill(made["d"].url, made["p"].port)
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


def test_greedy_with_mtp_layers_through_pd_equals_unified(fleet) -> None:
    p, d = fleet["p"], fleet["d"]
    assert isinstance(d, ServerProcess)
    before, p_before = load(d), load(p.server)
    for i, (ids, want) in enumerate(zip(fleet["prompts"], fleet["ref"])):
        r, pr = pair(p, d, ids, NEW)
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == want, (i, r.json()["output_ids"], want)
        assert pr.status_code == 200, pr
    at_rest(p.server, d)
    after, p_load = load(d), load(p.server)
    assert after["spec_verifies_total"] > before.get("spec_verifies_total", 0), after
    assert after["spec_draft_failures_total"] == 0, after
    assert after["disagg_chain_starts_received_total"] - before.get(
        "disagg_chain_starts_received_total", 0) == len(fleet["prompts"]), after
    assert p_load["spec_draft_passes_total"] > 0 and p_load["spec_verifies_total"] == 0, p_load
    pages = sum(-(-len(ids) // PAGE) for ids in fleet["prompts"])
    layer = pages * PAGE * KV_HEADS * HEAD_DIM * 4 * 2  # float32 K and V
    chain = len(fleet["prompts"]) * HIDDEN * 4  # the chain start's output vector
    moved = p_load["kv_bytes"] - p_before.get("kv_bytes", 0)
    assert moved == layer * (LAYERS + MTP) + chain, moved


def test_each_mtp_layer_is_one_more_draft_layer_of_the_kv_layout() -> None:
    pool = memory_pools().create("torch", PoolContext(rank=0))
    kv = KVCache(pool, LAYERS, 8, PAGE, KV_HEADS, HEAD_DIM, dtype=torch.float32)
    p = torch.nn.Parameter(torch.zeros(1), requires_grad=False)
    head = SimpleNamespace(name="MTP", num_layers=MTP, kv_layout=(KV_HEADS, HEAD_DIM, False),
                           parameters=lambda: iter([p]))
    drafter = MultiLayerDrafter(head, BlockManager(8, PAGE), 2, 4, kv.draft_buffer)
    a = kv.layout()
    assert (a.num_layers, a.draft_layers) == (LAYERS + MTP, MTP)
    assert len(kv.transfer_layers) == LAYERS + MTP and len(kv.regions()) == 2 * (LAYERS + MTP)
    assert [k for k, _ in kv.transfer_layers[LAYERS:]] == [k for k, _ in drafter.pools]
    assert len({t.data_ptr() for k, v in drafter.pools for t in (k, v)}) == 2 * MTP
    assert drafter.pool_bytes == MTP * 2 * drafter.k.numel() * 4
