"""Draft heads with `--enable-dp-attention` in PD mode (#33): each DP rank of P runs the head over
its prompts and sends the head's K/V (one more KV layer of its pool) and the chain start with the
target's pages; D's DP rank continues speculating from the first token.

- The seed page's two Ascend DeepSeek lines (prefill: NEXTN 1 step, TP 16 DP 8 with DP attention;
  decode: NEXTN 3 steps, TP 16 DP 16 with DP attention), the NPU's flags swapped for CPU ones
  (TP and DP 2, `--moe-a2a-backend none`, the tcp backend, float32, no modelslim quantization or
  CUDA graphs), served as P and D with a tiny DeepSeek-V3 and its MTP layer behind `pdserve
  router`: greedy output equals an engine's without speculation, token for token; both of P's DP
  ranks ran the MTP layer over their prompts and sent every chain start; both of D's DP ranks
  verified drafts, adopted every chain start, no head pass failed; every pool comes to rest.
- A tiny Qwen2-MoE with an EAGLE head, DP attention on both sides, over shm (segment mode): the
  same checks, and the head's K rows P computed (one per prompt position, over both DP ranks'
  segments) are all held by D's segments.

PDSERVE_SPEC_GATE=0 verifies every draft (the random heads' drafts are rejected, which the gate
would otherwise stop drafting for).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import torch
from draft_pd import draft_rows
from seed_moe_lines import SEEDS, loopback_argv, strip_flags, swap_values

from pdcore.config import ServerArgs
from pdcore.messages.io import SamplingParams
from pdcore.engine.model.tokenizer import default_model_file
from pdcore.runtime.llm_engine import LLMEngine
from pdcore.testing.pages import load_at_rest
from pdcore.testing.processes import PDCluster
from pdcore.testing.tiny_models import add_mtp_layer, make_eagle_head, make_tiny_model

pytestmark = [pytest.mark.timeout(400), pytest.mark.heavy]  # two DP/TP process trees

NEW = 12
POOL = ("--max-total-tokens", "2048", "--page-size", "4")
DPA = ("--tp-size", "2", "--dp-size", "2", "--enable-dp-attention")
ENV = {"PDSERVE_SPEC_GATE": "0"}
# the NPU / hardware-only flags of the seed lines, with how many values each takes (-1: a list)
NPU_ONLY = {"--device": 1, "--attention-backend": 1, "--quantization": 1, "--cuda-graph-bs": -1,
            "--tokenizer-worker-num": 1, "--deepep-mode": 1, "--host": 1, "--port": 1}
CPU_VALUES = {"--tp-size": "2", "--dp-size": "2", "--moe-a2a-backend": "none",
              "--disaggregation-transfer-backend": "tcp", "--dtype": "float32"}


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(4)
    return [torch.randint(3, 500, (k,), generator=g).tolist() for k in (7, 33, 18, 50)]


def _plain(path: str, prompts: list[list[int]]) -> list[list[int]]:
    eng = LLMEngine(ServerArgs(model_path=path, max_total_tokens=2048, page_size=4))
    try:
        return [r["output_ids"] for r in eng.generate(prompts, SamplingParams(
            max_new_tokens=NEW, temperature=0.0, ignore_eos=True))]
    finally:
        eng.close()


def _cpu_line(line: str, model: str) -> tuple[str, ...]:
    return (*swap_values(strip_flags(loopback_argv(line, model), NPU_ONLY), CPU_VALUES), *POOL)


def _serve_and_check(c: PDCluster, prompts: list[list[int]], want: list[list[int]],
                     after_each: Callable[[list[int]], None] | None = None) -> None:
    """Each prompt through the router, prompt i on P's DP rank i % 2: the tokens (then
    `after_each(ids)`), and what every DP rank of both sides did."""
    for i, (ids, ref) in enumerate(zip(prompts, want)):
        body = {"input_ids": ids, "disagg_prefill_dp_rank": i % 2, "sampling_params": {
            "max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True}}
        r = httpx.post(c.url + "/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == ref, i
        if after_each is not None:
            after_each(ids)
    p, d = c.prefills[0].loads(), c.decodes[0].loads()
    assert [x["dp_rank"] for x in p] == [x["dp_rank"] for x in d] == [0, 1]
    for x in p:  # each P rank ran the head over its prompts, drafted nothing, sent each start
        assert x["disagg_requests_total"] == 2 and x["spec_draft_passes_total"] > 0, x
        assert x["spec_verifies_total"] == 0, x
        assert x["disagg_chain_starts_sent_total"] == 2, x
        assert x["disagg_chain_starts_missing_total"] == 0, x
    assert sum(x["disagg_chain_starts_received_total"] for x in d) == len(prompts), d
    for x in d:
        assert x["spec_verifies_total"] > 0 and x["spec_draft_failures_total"] == 0, x
        assert x["disagg_chain_starts_dropped_total"] == 0, x
    c.wait_pages_free()
    assert all(load_at_rest(x) for s in c.prefills + c.decodes for x in s.loads())


def test_seed_ascend_deepseek_nextn_lines_serve_as_p_and_d(tmp_path) -> None:
    path = add_mtp_layer(make_tiny_model(str(tmp_path / "ds"), arch="deepseek_v3", seed=5,
                                         max_positions=8192,
                                         tokenizer_from=default_model_file()), seed=1)
    lines = {("prefill" if "-mode prefill" in line else "decode"): line
             for _, line in SEEDS if "NEXTN" in line}
    prompts = _prompts()
    want = _plain(path, prompts)
    c = PDCluster("tcp", env=ENV, prefill_flags=_cpu_line(lines["prefill"], path),
                  decode_flags=_cpu_line(lines["decode"], path))
    try:
        c.start()
        _serve_and_check(c, prompts, want)
    finally:
        c.stop()


def test_eagle_with_dp_attention_over_shm_moves_the_head_kv(tmp_path) -> None:
    path = make_tiny_model(str(tmp_path / "m"), arch="qwen2_moe", seed=9,
                           tokenizer_from=default_model_file())
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        cfg: dict[str, Any] = json.load(f)
    kv_heads, head_dim = cfg["num_key_value_heads"], cfg["hidden_size"] // cfg[
        "num_attention_heads"]
    head = make_eagle_head(str(tmp_path / "h"), seed=1, vocab=cfg["vocab_size"],
                           hidden=cfg["hidden_size"], heads=cfg["num_attention_heads"],
                           kv_heads=kv_heads)
    prompts = _prompts()
    want = _plain(path, prompts)
    spec = ("--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", head,
            "--speculative-num-steps", "3")
    c = PDCluster("shm", model_path=path, flags=(*POOL, *DPA, *spec),
                  env={**ENV, "PDCORE_SHM_MODE": "segment"})
    width = kv_heads * head_dim
    seen: set[bytes] = set()

    def moved(ids: list[int]) -> None:
        # one new K row per prompt position (DP attention over 2 ranks: each rank's attention
        # group is one rank, holding every KV head), all of them in D's segments too. Read
        # after each prompt: the free list hands a freed page out again first (LIFO), so a
        # later prompt may overwrite an earlier one's rows in either pool
        nonlocal seen
        p_rows = draft_rows(c.prefills[0], width)
        new = p_rows - seen
        assert len(new) == len(ids), (len(new), len(ids))
        assert new <= draft_rows(c.decodes[0], width)
        seen = p_rows

    try:
        c.start()
        _serve_and_check(c, prompts, want, moved)
    finally:
        c.stop()
