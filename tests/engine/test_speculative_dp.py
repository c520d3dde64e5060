"""Speculative decoding with `--tp-size 2 --dp-size 2 --enable-dp-attention` (#33), real servers.

EAGLE and EAGLE3 heads are dense (one Llama layer): their passes issue no MoE collective, only
their attention group's (the head is built with the target's DPAttnTPInfo, whose rank and size
are the attention group's; here one rank per DP rank, so none at all), so each DP rank drafts
and verifies on its own batch while the target's MoE layers keep the DP ranks in lockstep (a
verify is one forward, as a decode step is). Checked on a tiny Qwen2-MoE with random heads and
every draft verified (PDSERVE_SPEC_GATE=0): greedy output equals the same server without
speculation, token for token, for requests on both DP ranks and for an odd number pinned to
DP rank 0 while rank 1 idles; drafts were verified on both ranks, none failed, every wait is
bounded. NEXTN on a tiny DeepSeek-V3 with its MTP layer, whose MoE layer's collectives span
the DP ranks: every DP rank pads its head passes to the same count each step
(engine/parallel/dp_heads.py), with the same checks. A head with DP attention in PD mode:
tests/pd/test_pd_spec_dp.py.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
from typing import Any

import httpx
import pytest
import torch
from pdserve_testing import ServerProcess

from pdcore.config import ServerArgs
from pdcore.testing.tiny_models import (
    add_mtp_layer,
    make_eagle3_head,
    make_eagle_head,
    make_tiny_model,
)

pytestmark = [pytest.mark.timeout(300), pytest.mark.heavy]  # DP/TP process trees

NEW = 12
FLAGS = ("--max-total-tokens", "2048", "--page-size", "4", "--dp-size", "2", "--tp-size", "2",
         "--enable-dp-attention")
SPEC = ("--speculative-num-steps", "3", "--speculative-eagle-topk", "1")
# (DP rank of each request): spread over both, then three on rank 0 while rank 1 idles
RANKS = [[0, 1, 0, 1], [0, 0, 0]]


def _prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(4)
    return [torch.randint(3, 500, (k,), generator=g).tolist() for k in (7, 33, 18, 50)[:n]]


def _generate(server: ServerProcess, ids: list[int], rank: int) -> list[int]:
    body: dict[str, Any] = {"input_ids": ids, "data_parallel_rank": rank, "sampling_params": {
        "max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True}}
    r = httpx.post(server.url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def _serve(path: str, *flags: str) -> tuple[list[list[list[int]]], list[dict[str, Any]]]:
    """Each batch of RANKS sent concurrently to one server: (outputs per batch, its loads)."""
    server = ServerProcess("--model-path", path, *FLAGS, *flags,
                           env={"PDSERVE_SPEC_GATE": "0"})
    try:
        server.wait_healthy(180)
        outs = []
        for ranks in RANKS:
            prompts = _prompts(len(ranks))
            with cf.ThreadPoolExecutor(len(ranks)) as ex:
                outs.append(list(ex.map(lambda ids, r: _generate(server, ids, r), prompts,
                                        ranks)))
        return outs, server.loads()
    finally:
        server.stop()


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> dict[str, Any]:
    """The tiny MoE model, an EAGLE and an EAGLE3 head of its shape, its plain outputs."""
    from pdcore.engine.model.tokenizer import default_model_file

    root = tmp_path_factory.mktemp("spec_dp")
    path = make_tiny_model(str(root / "m"), arch="qwen2_moe", seed=9,
                           tokenizer_from=default_model_file())
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    shape = {"vocab": cfg["vocab_size"], "hidden": cfg["hidden_size"],
             "heads": cfg["num_attention_heads"], "kv_heads": cfg["num_key_value_heads"]}
    return {"path": path, "outs": _serve(path)[0],
            "EAGLE": make_eagle_head(str(root / "h"), seed=1, **shape),
            # the residual streams entering the 2-layer target's layers 0, 1 and 2
            "EAGLE3": make_eagle3_head(str(root / "h3"), seed=1, layer_ids=[-1, 0, 1],
                                       **shape)}


@pytest.mark.parametrize("algo", ["EAGLE", "EAGLE3"])
def test_head_with_dp_attention_equals_plain(plain, algo) -> None:
    got, loads = _serve(plain["path"], "--speculative-algorithm", algo, *SPEC,
                        "--speculative-draft-model-path", plain[algo])
    assert got == plain["outs"]
    assert [d["dp_rank"] for d in loads] == [0, 1]
    for d in loads:  # both DP ranks drafted and verified; no head pass failed
        assert d["spec_verifies_total"] > 0 and d["spec_draft_passes_total"] > 0, d
        assert d["spec_draft_failures_total"] == 0, d
    assert loads[1]["dp_idle_forwards_total"] > 0, loads[1]  # rank 1 idled for rank 0's steps


def test_nextn_with_dp_attention_equals_plain(tmp_path) -> None:
    """NEXTN's MTP layer holds a MoE layer: every DP rank pads its head passes to the same count
    each step (engine/parallel/dp_heads.py); rank 1 idles through rank 0's steps, its idle
    forwards padded with idle head passes."""
    from pdcore.engine.model.tokenizer import default_model_file

    path = add_mtp_layer(make_tiny_model(str(tmp_path / "d"), arch="deepseek_v3", seed=5,
                                         tokenizer_from=default_model_file()), seed=1)
    plain, _ = _serve(path)
    got, loads = _serve(path, "--speculative-algorithm", "NEXTN", *SPEC)
    assert got == plain
    for d in loads:
        assert d["spec_verifies_total"] > 0 and d["spec_draft_passes_total"] > 0, d
        assert d["spec_draft_failures_total"] == 0, d
        assert d["dp_head_idle_passes_total"] > 0, d
    assert loads[1]["dp_idle_forwards_total"] > 0, loads[1]


def test_flags() -> None:
    for algo, extra in (("EAGLE", {"speculative_draft_model_path": "/x"}),
                        ("EAGLE3", {"speculative_draft_model_path": "/x"}), ("NEXTN", {})):
        for mode in ("null", "prefill", "decode"):  # PD: tests/pd/test_pd_spec_dp.py
            ServerArgs(speculative_algorithm=algo, disaggregation_mode=mode, tp_size=2,
                       dp_size=2, enable_dp_attention=True, **extra).validate()
