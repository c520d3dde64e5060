"""Speculative decoding with `--tp-size 2` (#33: identity tests at TP 1 and 2), unified engine.

Every algorithm on a TP 2 engine (a rank-1 process beside the in-process rank 0, gloo): greedy
output with speculation equals plain greedy at TP 1 and transformers', token for token, drafts
verified (NGRAM's accepted too; a random head's rarely are: the agreeing heads below), every
page free at the end, and no draft pass lost:
- NGRAM on a tiny Llama of 6 query / 3 KV heads (1 + 2 on two ranks);
- EAGLE: a random EAGLE-1 head of that shape; its layer sharded as the target's (uneven KV
  heads too), every rank runs its passes, rank 0's draft tokens agreed (engine/sched/draft_tp.py);
- NEXTN: a tiny DeepSeek-V3 (MLA, MoE experts sharded over the two ranks, or whole experts
  per rank with --ep-size 2) with its MTP layer;
- multi-layer MTP (`--enable-multi-layer-eagle`): a tiny MiMo of that shape with 3 MTP layers,
  each sharded as the target's layers;
- a head built to agree with its target (EAGLE, NEXTN and a MiMo's 3 MTP layers): accept length
  well above 1 under TP 2, as at TP 1.
The agreement itself on a two-rank gloo group: rank 0's argmax reaches rank 1, a pass that
raised on one rank drops the drafts on both, a chain start not held alike is dropped on both.
Flags: EAGLE / NEXTN take --tp-size 2, and DP attention on a unified server
(tests/engine/test_speculative_dp.py; in PD mode tests/pd/test_pd_spec_dp.py).
PD with TP 2 on both sides: tests/pd/test_pd_spec_tp.py.
"""

from __future__ import annotations

import os

import pytest
import torch

from pdcore.config import ServerArgs
from pdcore.messages.io import SamplingParams
from pdcore.engine.model.layers import TPInfo
from pdcore.engine.sched.draft_tp import DraftsDropped, TokenAgreement
from pdcore.runtime.llm_engine import LLMEngine
from pdcore.testing.greedy import check_greedy, hf_greedy
from pdcore.testing.pages import pages_at_rest
from pdcore.testing.ports import free_port
from pdcore.testing.tiny_models import (
    add_mtp_layer,
    make_eagle_head,
    make_tiny_mimo,
    make_tiny_model,
    mimo_reference,
)

pytestmark = pytest.mark.heavy  # TP process trees

VOCAB, HIDDEN, HEADS, KV_HEADS = 512, 96, 6, 3  # 3 KV heads: 1 + 2 on two ranks
NEW = 24
SP = SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)


def _zero_layers(path: str, mtp: dict[str, torch.Tensor] | None = None) -> str:
    """The model at `path` with o_proj and every down projection zero: its layers add nothing,
    so its next token is a function of the current one alone (a bigram model); `mtp`: weights
    to set besides."""
    from safetensors.torch import load_file, save_file

    f = os.path.join(path, "model.safetensors")
    sd = load_file(f)
    for k in sd:
        if k.endswith(("o_proj.weight", "down_proj.weight")):
            sd[k] = torch.zeros_like(sd[k])
    sd.update(mtp or {})
    save_file(sd, f, metadata={"format": "pt"})
    return path


def _bigram_deepseek(path: str) -> str:
    """A bigram DeepSeek-V3 whose MTP layer predicts just what it does (eh_proj passes
    enorm(embedding) through, enorm has the final norm's weight, the layer adds nothing)."""
    from safetensors.torch import load_file

    make_tiny_model(path, arch="deepseek_v3", layers=2, seed=9)
    add_mtp_layer(path, seed=4)
    norm = load_file(os.path.join(path, "model.safetensors"))["model.norm.weight"]
    h, p = norm.shape[0], "model.layers.2."
    return _zero_layers(path, {p + "eh_proj.weight": torch.cat([torch.eye(h),
                                                                torch.zeros(h, h)], 1),
                               p + "enorm.weight": norm.clone(),
                               p + "shared_head.norm.weight": torch.ones(h)})


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec_tp")
    shape = {"hidden": HIDDEN, "heads": HEADS, "kv_heads": KV_HEADS}
    return {
        "llama": make_tiny_model(str(root / "l"), vocab_size=VOCAB, seed=5, **shape),
        "head": make_eagle_head(str(root / "h"), vocab=VOCAB, seed=1, **shape),
        "bigram": _zero_layers(make_tiny_model(str(root / "b"), vocab_size=VOCAB, seed=9,
                                               **shape)),
        "perfect": make_eagle_head(str(root / "p"), vocab=VOCAB, seed=3, perfect=True,
                                   **shape),
        "deepseek": add_mtp_layer(make_tiny_model(str(root / "d"), arch="deepseek_v3",
                                                  layers=2, seed=5), seed=1),
        "bigram_ds": _bigram_deepseek(str(root / "bd")),
        "mimo": make_tiny_mimo(str(root / "mm"), mtp_layers=3, seed=1, vocab_size=VOCAB,
                               **shape),
        "bigram_mimo": make_tiny_mimo(str(root / "ma"), mtp_layers=3, seed=2, agree=True,
                                      vocab_size=VOCAB, **shape),
    }


def _prompts(n: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, VOCAB, (k,), generator=g).tolist() for k in (12, 45, 30)[:n]]


def _spec(algo: str, head: str | None = None) -> dict:
    if algo == "NGRAM":
        return {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 5}
    if algo == "MIMO":  # the MiMo's own 3 MTP layers, a 4-step chain (the last layer twice)
        return {"speculative_algorithm": "EAGLE", "enable_multi_layer_eagle": True,
                "speculative_num_steps": 4, "speculative_eagle_topk": 1}
    return {"speculative_algorithm": algo, "speculative_draft_model_path": head,
            "speculative_num_steps": 3, "speculative_eagle_topk": 1}


def _run(path: str, tp: int, prompts, spec: dict | None = None, twice: bool = False):
    """(outputs, stats) of `prompts` on an engine of TP `tp` (`twice`: then the first two
    again, drafted from the first answers: NGRAM's cross-request cache); every page free at the
    end, every rank process gone after close."""
    eng = LLMEngine(ServerArgs(model_path=path, max_total_tokens=1024, page_size=4,
                               chunked_prefill_size=32, tp_size=tp, **(spec or {})))
    try:
        outs = eng.generate(prompts, SP, return_logprob=True)
        if twice:
            outs += eng.generate(prompts[:2], SP, return_logprob=True)
        assert pages_at_rest(eng.scheduler)
        stats = eng.loop.stats().as_dict()
        drafter = eng.loop.spec.drafter if spec else None
        if drafter is not None and hasattr(drafter, "failures"):
            assert drafter.failures == 0
            stats["draft_pool_heads"] = drafter.k.shape[2]  # rank 0's share of the head's
    finally:
        eng.close()
    assert all(not p.is_alive() for p in eng.ranks.children), "a TP rank outlived close()"
    return outs, stats


def _ids(outs) -> list[list[int]]:
    return [o["output_ids"] for o in outs]


@pytest.mark.parametrize("algo,ep", [("NGRAM", 1), ("EAGLE", 1), ("NEXTN", 1), ("NEXTN", 2),
                                    ("MIMO", 1)])
def test_tp2_speculative_greedy_equals_tp1_plain_and_transformers(models, monkeypatch, algo,
                                                                   ep):
    monkeypatch.setenv("PDSERVE_SPEC_GATE", "0")  # verify every draft
    path = models[{"NEXTN": "deepseek", "MIMO": "mimo"}.get(algo, "llama")]
    prompts = _prompts()
    twice = algo == "NGRAM"
    plain, _ = _run(path, 1, prompts, twice=twice)
    spec = {**_spec(algo, models["head"] if algo == "EAGLE" else None), "ep_size": ep}
    got, st = _run(path, 2, prompts, spec, twice=twice)
    assert st["spec_verifies_total"] > 0 and st["spec_draft_tokens_total"] > 0, st
    assert _ids(got) == _ids(plain)
    if algo == "NGRAM":  # a random head rarely agrees: acceptance is the next test's
        assert st["spec_accepted_tokens_total"] > 0, st
    else:
        assert st["spec_draft_passes_total"] > 0 and st["spec_draft_failures_total"] == 0, st
        # the head's layer is sharded: rank 0 holds 1 of the 3 KV heads; MLA's latent whole
        assert st["draft_pool_heads"] == 1, st
    if algo == "MIMO":  # its Qwen2 body (MiMo's own class is remote code)
        hf = mimo_reference(path)
        hf.generation_config.eos_token_id = None  # as ignore_eos
    else:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for o, p in zip(got, prompts + prompts[:2]):
        check_greedy(o["output_ids"], hf_greedy(hf, p, NEW),
                     [lp[0] for lp in o["output_logprobs"]])


@pytest.mark.parametrize("algo", ["EAGLE", "NEXTN", "MIMO"])
def test_tp2_agreeing_head_is_accepted(models, monkeypatch, algo):
    """A head that predicts its bigram target exactly: under TP 2 nearly every draft is
    accepted (accept length > 3 of at most 4; the MiMo's 4-step chains: > 4 of at most 5),
    and the output is TP 1's."""
    monkeypatch.setenv("PDSERVE_SPEC_GATE", "0")
    path = models[{"NEXTN": "bigram_ds", "MIMO": "bigram_mimo"}.get(algo, "bigram")]
    prompts = _prompts(2)
    plain, _ = _run(path, 1, prompts)
    got, st = _run(path, 2, prompts, _spec(algo, models["perfect"] if algo == "EAGLE" else None))
    assert _ids(got) == _ids(plain)
    steps = 4 if algo == "MIMO" else 3
    assert st["spec_accept_length"] > steps, st
    assert st["spec_verifies_total"] <= 2 * (NEW // steps), st


def _agreement_rank(rank: int, port: int, q) -> None:
    """One rank of test_token_agreement_on_two_ranks (spawned: module level)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    try:
        g = dist.group.WORLD
        agree = TokenAgreement(TPInfo(rank, 2, g, g), torch.device("cpu"))
        h = torch.eye(3)
        # rank 1's own scores would pick other tokens: rank 0's are the ones every rank uses
        out: dict = {"tokens": agree.argmax(lambda x: x.flip(-1) if rank else x, h)}
        try:  # a pass that raised on rank 1 only
            if rank == 1:
                raise RuntimeError("the head failed here")
            agree.argmax(lambda x: x, h)
            out["dropped"] = False
        except DraftsDropped:
            agree.failed(None)
            out["dropped"] = True
        except RuntimeError:
            agree.failed(3)
            out["dropped"] = True
        out["common"] = agree.common([5, -1, 7, 9] if rank == 0 else [5, 6, 8, 9])
        q.put((rank, out))
    finally:
        dist.destroy_process_group()


def test_token_agreement_on_two_ranks():
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_agreement_rank, args=(r, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    for rank in (0, 1):
        assert got[rank] == {"tokens": [0, 1, 2], "dropped": True, "common": [5, -1, -1, 9]}


def test_flags_take_tp_and_dp_attention_for_dense_heads():
    """DP attention: EAGLE and NEXTN run on unified servers (tests/engine/test_speculative_dp.py)
    and in PD mode (tests/pd/test_pd_spec_dp.py)."""
    for algo, extra in (("EAGLE", {"speculative_draft_model_path": "/x"}), ("NEXTN", {})):
        for mode in ("null", "prefill", "decode"):
            ServerArgs(speculative_algorithm=algo, tp_size=2, disaggregation_mode=mode,
                       **extra).validate()
    dpa = {"tp_size": 2, "dp_size": 2, "enable_dp_attention": True}
    for algo, extra in (("EAGLE", {"speculative_draft_model_path": "/x"}), ("NEXTN", {})):
        for mode in ("null", "prefill", "decode"):
            ServerArgs(speculative_algorithm=algo, disaggregation_mode=mode, **dpa,
                       **extra).validate()
