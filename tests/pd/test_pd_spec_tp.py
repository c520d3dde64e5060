"""Draft heads through PD with tensor parallelism (#33: EAGLE, NEXTN and a MiMo's multi-layer MTP
with --tp-size 2).

The head's layer is sharded as the target's (engine/sched/draft_tp.py), so each rank's draft
pool has the target's per-rank geometry and travels as one more KV layer of it: rank to rank
with equal TP, head slices with unequal TP (the default planner), NEXTN's latent whole on every
rank. For EAGLE (a tiny Llama of 6 query / 3 KV heads: 1 + 2 on two ranks) and NEXTN (a tiny
DeepSeek-V3 with its MTP layer, MoE experts sharded), over tcp:
- 1P1D, TP 2 on both sides: greedy output equals a unified TP 1 engine's without speculation,
  token for token; D verified drafts and adopted P's chain start for every request (it reached
  both D ranks alike, or no rank would have drafted from it); P ran the head and drafted
  nothing; with max_new_tokens=3 D's first decode step verifies a draft; every page comes back;
- P TP 1 -> D TP 2 (the draft layer split by heads as the target's layers): the same identity;
- multi-layer MTP (`--enable-multi-layer-eagle`, a tiny MiMo of that shape with 3 MTP layers,
  each sharded as the target's, N more KV layers crossing) over shm: the same identities, and
  the first MTP layer's K rows checked as EAGLE's below;
- EAGLE over shm (segment mode): the draft K rows each P rank computed for a prompt are read
  back from the segments and D's ranks hold them, rank for rank at TP 2, and P TP 1's rows
  split by KV head (head 0 on D rank 0, heads 1-2 on rank 1);
- EAGLE with pd-staging on every server: P TP 1 -> D TP 2 goes through the staging buffers
  (the draft layer gathered and scattered per head as the target's), the same identity.
Servers are paired by hand (the router's fan-out, tests/pd/draft_pd.py); one fleet per
algorithm and backend, three servers at a time. PDSERVE_SPEC_GATE=0 verifies every draft.
"""

from __future__ import annotations

import importlib.util
import json
import os
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from draft_pd import Prefill, at_rest, decode, load, pair, server

from pdcore.config import ServerArgs
from pdcore.messages.io import SamplingParams
from pdcore.engine.model.tokenizer import default_model_file
from pdcore.runtime.llm_engine import LLMEngine
from pdcore.testing.processes import ServerProcess, trust_prefill
from pdcore.testing.tiny_models import (
    add_mtp_layer,
    make_eagle_head,
    make_tiny_mimo,
    make_tiny_model,
)

pytestmark = pytest.mark.heavy  # TP process trees

NEW = 16
HIDDEN, HEADS, KV_HEADS = 96, 6, 3
TP2 = ("--tp-size", "2")
DIM = HIDDEN // HEADS  # one KV head's K values in a draft pool row (float32)


def _models(root: Any, algo: str) -> tuple[str, tuple[str, ...]]:
    """(model folder, speculative flags) of a tiny model with the tokenizer servers need."""
    tok = default_model_file()
    if algo == "MIMO":  # its own 3 MTP layers, each sharded as the target's layers
        model = make_tiny_mimo(str(root / "mm"), mtp_layers=3, seed=13, hidden=HIDDEN,
                               heads=HEADS, kv_heads=KV_HEADS, tokenizer_from=tok)
        return model, ("--speculative-algorithm", "EAGLE", "--enable-multi-layer-eagle",
                       "--speculative-num-steps", "4")
    if algo == "NEXTN":
        model = add_mtp_layer(make_tiny_model(str(root / "ds"), arch="deepseek_v3", layers=2,
                                              seed=13, tokenizer_from=tok), seed=1)
        return model, ("--speculative-algorithm", "NEXTN", "--speculative-num-steps", "3")
    model = make_tiny_model(str(root / "m"), seed=13, hidden=HIDDEN, heads=HEADS,
                            kv_heads=KV_HEADS, tokenizer_from=tok)
    with open(os.path.join(model, "config.json"), encoding="utf-8") as f:
        vocab = json.load(f)["vocab_size"]
    head = make_eagle_head(str(root / "h"), vocab=vocab, hidden=HIDDEN, heads=HEADS,
                           kv_heads=KV_HEADS, seed=1)
    return model, ("--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", head,
                   "--speculative-num-steps", "3")


@pytest.fixture(scope="module", params=[("EAGLE", "tcp"), ("NEXTN", "tcp"), ("EAGLE", "shm"),
                                        ("MIMO", "shm"), ("EAGLE", "staging")],
                ids=["eagle-tcp", "nextn-tcp", "eagle-shm", "mimo-shm", "eagle-staging"])
def fleet(request, tmp_path_factory) -> Any:
    algo, backend = request.param
    if backend == "staging" and importlib.util.find_spec("pd_staging") is None:
        pytest.skip("pd-staging not installed (pip install -e plugins/pd-staging)")
    model, spec = _models(tmp_path_factory.mktemp(f"pd_tp_{algo.lower()}"), algo)
    common = ("--model-path", model, *spec)
    made: dict[str, Any] = {}
    try:
        with pytest.MonkeyPatch.context() as mp:  # the servers' environment (staging: all)
            if backend == "staging":
                mp.setenv("SGLANG_DISAGG_STAGING_BUFFER", "1")
                mp.setenv("SGLANG_DISAGG_STAGING_POOL_SIZE_MB", "64")  # not 4 GiB on a host
            wire = "tcp" if backend == "staging" else backend
            made["p2"] = Prefill(wire, *common, *TP2)
            made["p1"] = Prefill(wire, *common)
            made["d2"] = decode(wire, *common, *TP2)
        for s in made.values():
            server(s).wait_healthy(300)
        trust_prefill(made["d2"].url, made["p2"].port, made["p1"].port)
        g = torch.Generator().manual_seed(4)
        prompts = [torch.randint(100, 40000, (n,), generator=g).tolist() for n in (23, 9, 41)]
        eng = LLMEngine(ServerArgs(model_path=model, max_total_tokens=1024, page_size=4))
        try:
            ref = eng.generate(prompts, SamplingParams(max_new_tokens=NEW, temperature=0.0,
                                                       ignore_eos=True))
        finally:
            eng.close()
        yield {**made, "algo": algo, "backend": backend, "prompts": prompts,
               "ref": [r["output_ids"] for r in ref]}
    finally:
        for s in made.values():
            server(s).stop()


@pytest.mark.parametrize("p_name", ["p2", "p1"])
def test_tp2_decode_with_a_draft_head_equals_unified(fleet, p_name) -> None:
    p, d = fleet[p_name], fleet["d2"]
    assert isinstance(d, ServerProcess)
    before, p_before = load(d), load(p.server)
    n = len(fleet["prompts"])
    for i, (ids, want) in enumerate(zip(fleet["prompts"], fleet["ref"])):
        if fleet["backend"] == "shm" and i == 0:
            p_rows = _rank_rows(p.server)
            r, pr = pair(p, d, ids, NEW)
            _check_rows(p.server, p_rows, d, len(ids))
        else:
            r, pr = pair(p, d, ids, NEW)
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == want, (fleet["algo"], p_name, i)
        assert isinstance(pr, httpx.Response) and pr.status_code == 200, pr
    after, p_load = load(d), load(p.server)

    def grew(now: dict, then: dict, key: str) -> int:
        return now[key] - then.get(key, 0)

    assert grew(after, before, "spec_verifies_total") > 0, after
    assert after["spec_draft_failures_total"] == 0, after
    assert grew(after, before, "disagg_chain_starts_received_total") == n, after
    assert after["disagg_chain_starts_dropped_total"] == 0, after
    assert grew(p_load, p_before, "spec_draft_passes_total") > 0, p_load
    assert p_load["spec_verifies_total"] == 0 and p_load["spec_draft_failures_total"] == 0
    if fleet["backend"] == "staging":  # unequal TP through the staging buffers, equal TP not
        staged = p_load.get("kv_staged_bytes", 0) - p_before.get("kv_staged_bytes", 0)
        assert (staged > 0) == (p_name == "p1"), p_load
    at_rest(p.server, d)
    for ids, want in zip(fleet["prompts"], fleet["ref"]):  # D's first decode step drafts
        r, _ = pair(p, d, ids, 3)
        assert r.status_code == 200 and r.json()["output_ids"] == want[:3], r.text
        assert r.json()["meta_info"]["spec_verify_ct"] >= 1, r.json()["meta_info"]
    at_rest(p.server, d)


def _descendants(pid: int) -> set[int]:
    kids: dict[int, list[int]] = {}
    for e in os.listdir("/proc"):
        if e.isdigit():
            try:
                with open(f"/proc/{e}/stat") as f:
                    kids.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(e))
            except OSError:
                continue
    out, todo = set(), [pid]
    while todo:
        for k in kids.get(todo.pop(), []):
            if k not in out:
                out.add(k)
                todo.append(k)
    return out


def _rank_rows(s: ServerProcess) -> list[set[bytes]]:
    """Per TP rank (rank 0 first: 3 KV heads split 1 + 2, so its segment is the smaller) the
    non-zero rows of the server's draft-K segment (/dev/shm/pdserve_<id>_<pid>_draft-k: the
    head's, or a MiMo's first MTP layer's)."""
    pids = _descendants(s.proc.pid)
    names = sorted((n for n in os.listdir("/dev/shm") if n.endswith("_draft-k")
                    and any(f"_{pid}_" in n for pid in pids)),
                   key=lambda n: os.path.getsize(os.path.join("/dev/shm", n)))
    assert names, pids
    heads = [1, 2] if len(names) == 2 else [KV_HEADS]
    out = []
    for name, h in zip(names, heads, strict=True):
        raw = np.fromfile(os.path.join("/dev/shm", name), dtype=np.float32)
        rows = raw[: len(raw) // (h * DIM) * h * DIM].reshape(-1, h * DIM)
        out.append({r.tobytes() for r in rows[np.abs(rows).sum(1) > 0]})
    return out


def _check_rows(p: ServerProcess, before: list[set[bytes]], d: ServerProcess, n: int) -> None:
    """Every prompt position's draft K row P's ranks wrote is in D's ranks' pools: rank for
    rank, or (P TP 1) split by KV head as the target's layers are."""
    new = [now - then for now, then in zip(_rank_rows(p), before, strict=True)]
    held = _rank_rows(d)
    assert all(len(x) == n for x in new), [len(x) for x in new]
    if len(new) == 2:
        assert new[0] <= held[0] and new[1] <= held[1]
        return
    split = [{r[:DIM * 4] for r in new[0]}, {r[DIM * 4:] for r in new[0]}]  # float32 bytes
    assert split[0] <= held[0] and split[1] <= held[1]
