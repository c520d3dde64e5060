"""NEXTN speculative decoding (#33): a DeepSeek-V3 checkpoint's own MTP layer drafts chains.

- a tiny random DeepSeek-V3 (MLA + MoE) saved WITH an MTP layer at index L (written into the
  state dict: transformers creates none): greedy output with NEXTN equals greedy without it and
  transformers', token for token, at batch 1 and several, page sizes 1, 4 and 16, steps 1 and
  3 (the seed lines' settings), rerun from the prefix cache, every page free at the end;
- the drafter's incremental drafts (the MTP layer's latent K/V written after every target step
  into the request's pages, the chain on scratch slots) equal the layer run from scratch;
- an MTP layer built to agree with its target (a target whose next token depends on the
  current one alone, a layer that passes the token's normed embedding through): nearly every
  draft is accepted and the counters show it;
- flags and models: NEXTN takes topk 1, steps k and k + 1 draft tokens, validates in PD mode
  (tests/pd/test_pd_nextn.py), takes TP > 1 and DP attention on a unified server (tests/engine/test_speculative_dp.py; refused in PD mode), and exits 2 for a model that is not a DeepSeek-V3 or has no MTP layer.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from pdcore.config import ServerArgs
from pdcore.messages.io import SamplingParams
from pdcore.errors import ConfigError
from pdcore.runtime.llm_engine import LLMEngine
from pdcore.testing.greedy import check_greedy, hf_greedy
from pdcore.testing.pages import pages_at_rest
from pdcore.testing.tiny_models import add_mtp_layer, make_tiny_model

VOCAB = 512


def make_bigram_target(path: str) -> str:
    """A tiny DeepSeek-V3 whose layers add nothing (o_proj and every down projection zero: its
    next token is argmax lm_head(norm(embedding(token)))) with an MTP layer that predicts just
    that from the token after the hidden state: eh_proj passes enorm(embedding) through (the
    FIRST half of its input), enorm has the final norm's weight, its layer adds nothing."""
    from safetensors.torch import load_file, save_file

    make_tiny_model(path, arch="deepseek_v3", layers=2, seed=9)
    add_mtp_layer(path, seed=4)
    f = os.path.join(path, "model.safetensors")
    sd = load_file(f)
    for k in sd:
        if k.endswith(("o_proj.weight", "down_proj.weight")):
            sd[k] = torch.zeros_like(sd[k])
    h = sd["model.norm.weight"].shape[0]
    p = "model.layers.2."
    sd[p + "eh_proj.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], 1)
    sd[p + "enorm.weight"] = sd["model.norm.weight"].clone()
    sd[p + "shared_head.norm.weight"] = torch.ones(h)
    save_file(sd, f, metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("nextn")
    plain = make_tiny_model(str(root / "plain"), arch="deepseek_v3", layers=2, seed=5)
    no_mtp = make_tiny_model(str(root / "zero"), arch="deepseek_v3", layers=2, seed=5)
    with open(os.path.join(no_mtp, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    cfg["num_nextn_predict_layers"] = 0
    with open(os.path.join(no_mtp, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f)
    return {
        "mtp": add_mtp_layer(make_tiny_model(str(root / "m"), arch="deepseek_v3", layers=2,
                                             seed=5), seed=1),
        "own_head": add_mtp_layer(make_tiny_model(str(root / "o"), arch="deepseek_v3",
                                                  layers=2, seed=6), seed=2, own_head=True),
        "bigram": make_bigram_target(str(root / "b")),
        "no_weights": plain,  # num_nextn_predict_layers 1 (V3's default), no MTP weights
        "no_mtp": no_mtp,
        "llama": make_tiny_model(str(root / "l"), seed=3),
    }


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (12, 45, 7, 70)]


def _engine(path: str, nextn: bool, steps: int = 3, **kw) -> LLMEngine:
    extra = {"speculative_algorithm": "NEXTN", "speculative_num_steps": steps,
             "speculative_eagle_topk": 1, "speculative_num_draft_tokens": steps + 1} \
        if nextn else {}
    return LLMEngine(ServerArgs(model_path=path, max_total_tokens=2048,
                                page_size=kw.pop("page_size", 4),
                                chunked_prefill_size=kw.pop("chunk", 32), **extra, **kw))


def _generate(path: str, nextn: bool, prompts, sp: SamplingParams, **kw):
    """Outputs of `prompts` then of the first two again (from the prefix cache), and the
    stats."""
    eng = _engine(path, nextn, **kw)
    try:
        outs = eng.generate(prompts, sp, return_logprob=True)
        again = eng.generate(prompts[:2], sp, return_logprob=True)
        assert pages_at_rest(eng.scheduler)
        stats = eng.loop.stats().as_dict()
        if nextn:
            assert eng.loop.spec.drafter.failures == 0
            assert eng.loop.spec.drafter.head.name == "NEXTN"
    finally:
        eng.close()
    return outs + again, stats


@pytest.mark.parametrize("page_size,batch,steps", [(1, 4, 3), (16, 3, 3), (4, 1, 3),
                                                   (4, 4, 1)])
def test_greedy_with_nextn_equals_without_and_transformers(models, monkeypatch, page_size,
                                                            batch, steps):
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("PDSERVE_SPEC_GATE", "0")  # verify every draft
    prompts = _prompts()[:batch]
    sp = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    base, _ = _generate(models["mtp"], False, prompts, sp, page_size=page_size)
    got, st = _generate(models["mtp"], True, prompts, sp, page_size=page_size, steps=steps)
    assert st["spec_verifies_total"] > 0 and st["spec_draft_tokens_total"] > 0, st
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in base]
    # the reruns from the prefix cache (draft K/V in the cached pages) equal the first runs
    assert [o["output_ids"] for o in got[batch:]] == [o["output_ids"] for o in got[:min(2, batch)]]
    for a, b in zip(got, base):
        assert torch.allclose(torch.tensor([e[0] for e in a["output_logprobs"]]),
                              torch.tensor([e[0] for e in b["output_logprobs"]]), atol=1e-3)
    hf = AutoModelForCausalLM.from_pretrained(models["mtp"], dtype=torch.float32).eval()
    verdicts = [check_greedy(o["output_ids"], hf_greedy(hf, p, 24),
                             [e[0] for e in o["output_logprobs"]], logprob_tol=1e-3)
                for p, o in zip(prompts, got)]
    assert verdicts.count("identical") >= len(prompts) - 1, verdicts


def test_own_embedding_and_head_of_the_mtp_layer(models, monkeypatch):
    """A checkpoint whose MTP layer has its own embed_tokens and shared_head.head (they differ
    from the target's): the head uses them, and the output is still the target's."""
    monkeypatch.setenv("PDSERVE_SPEC_GATE", "0")
    prompts = _prompts()[:3]
    sp = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    base, _ = _generate(models["own_head"], False, prompts, sp)
    eng = _engine(models["own_head"], True)
    try:
        head = eng.loop.spec.drafter.head
        assert head.embed is not None and head.own_head is not None
        outs = eng.generate(prompts, sp)
        assert pages_at_rest(eng.scheduler)
    finally:
        eng.close()
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in base[:3]]


def _reference_drafts(target, head, tokens: list[int], c: int, k: int) -> list[int]:
    """k drafts after `tokens` (c = len(tokens) - 1 positions computed), from scratch: the
    target's final-norm hidden states over the whole sequence, then each chain step runs the
    MTP layer over every pair again (a fresh latent pool each time)."""
    from pdcore.engine.model.batch import ForwardBatch, SeqSpan

    lat = head.kv_layout[1]

    def pool() -> torch.Tensor:
        return torch.zeros(c + k, 1, 1, lat)

    def batch(ids: list[int]) -> ForwardBatch:
        n = len(ids)
        return ForwardBatch(torch.tensor(ids), torch.arange(n), torch.arange(n),
                            [SeqSpan(0, n, torch.arange(n))], torch.empty(0, dtype=torch.long))

    b = batch(tokens[:c])
    b.capture_hidden = True
    target(b, [(t, t) for t in (pool() for _ in target.layers)], logits=False)
    feats, ids, out = list(b.hidden), tokens[1 : c + 1], []
    for _ in range(k):
        cache = pool()
        g = head(batch(ids), torch.stack(feats), cache, cache)
        out.append(int(head.logits(g[-1:]).argmax()))
        feats.append(g[-1])
        ids = ids + [out[-1]]
    return out


def test_incremental_drafts_equal_the_mtp_layer_run_from_scratch(models, monkeypatch):
    monkeypatch.setenv("PDSERVE_SPEC_GATE", "0")
    eng = _engine(models["mtp"], True, steps=4, chunk=16)
    drafter = eng.loop.spec.drafter
    seen: list[tuple[list[int], int, list[int]]] = []
    propose = drafter.propose

    def record(reqs, wants):
        out = propose(reqs, wants)
        seen.extend((r.prompt + r.output, r.num_computed, d) for r, d in zip(reqs, out) if d)
        return out

    drafter.propose = record
    try:
        prompts = _prompts()
        eng.generate(prompts + [prompts[1][:30] + [7, 8]],  # a prefix-cache hit
                     SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True))
        target = eng.loop.runner.model
        assert len(seen) > 10 and any(len(d) == 4 for _, _, d in seen)
        for tokens, c, drafts in seen[::4]:
            assert len(tokens) == c + 1
            assert drafts == _reference_drafts(target, drafter.head, tokens, c, len(drafts))
    finally:
        eng.close()


def test_an_mtp_layer_that_agrees_with_its_target_gets_its_drafts_accepted(models,
                                                                          monkeypatch):
    monkeypatch.setenv("PDSERVE_SPEC_GATE", "0")
    prompts = _prompts()
    sp = SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True)
    base, _ = _generate(models["bigram"], False, prompts, sp)
    got, st = _generate(models["bigram"], True, prompts, sp, steps=4)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in base]
    assert st["spec_accept_rate"] > 0.9, st
    assert st["spec_accept_length"] > 4.0, st  # 4 drafts + the target's own token per verify
    assert st["spec_accepted_tokens_total"] > 0.9 * st["spec_draft_tokens_total"], st


def test_sampled_requests_with_nextn(models, monkeypatch):
    monkeypatch.setenv("PDSERVE_SPEC_GATE", "0")
    eng = _engine(models["mtp"], True)
    try:
        outs = eng.generate(_prompts(), SamplingParams(max_new_tokens=12, temperature=0.8,
                                                       top_p=0.9, seed=4, ignore_eos=True))
        assert all(len(o["output_ids"]) == 12 for o in outs)
        assert eng.loop.stats()["spec_verifies_total"] > 0
        assert pages_at_rest(eng.scheduler)
    finally:
        eng.close()


def test_flags():
    ok = ServerArgs(speculative_algorithm="nextn")
    ok.validate()
    assert (ok.speculative_algorithm, ok.speculative_num_steps, ok.speculative_eagle_topk,
            ok.speculative_num_draft_tokens) == ("NEXTN", 3, 1, 4)
    one = ServerArgs(speculative_algorithm="NEXTN", speculative_num_steps=1,
                     speculative_eagle_topk=1, speculative_num_draft_tokens=2)
    one.validate()
    assert one.speculative_num_draft_tokens == 2
    with pytest.raises(ConfigError, match="must be 4"):
        ServerArgs(speculative_algorithm="NEXTN", speculative_num_steps=3,
                   speculative_num_draft_tokens=3).validate()
    with pytest.raises(ConfigError, match="topk 2: only 1"):
        ServerArgs(speculative_algorithm="NEXTN", speculative_eagle_topk=2).validate()
    for mode in ("prefill", "decode"):  # PD: its latent K/V travel as one more MLA layer
        ServerArgs(speculative_algorithm="NEXTN", disaggregation_mode=mode).validate()
    ServerArgs(speculative_algorithm="NEXTN", tp_size=2).validate()  # test_speculative_tp.py
    ServerArgs(speculative_algorithm="NEXTN", tp_size=2, dp_size=2,
               enable_dp_attention=True).validate()  # test_speculative_dp.py
    ServerArgs(speculative_algorithm="NEXTN", tp_size=2, dp_size=2, enable_dp_attention=True,
               disaggregation_mode="decode").validate()  # tests/pd/test_pd_spec_dp.py


@pytest.mark.parametrize("model,says", [
    ("llama", "not one of"), ("no_mtp", "has no MTP layer"),
    ("no_weights", "holds no MTP layer weights")])
def test_models_without_an_mtp_layer_are_refused(models, capsys, model, says):
    """At the command line (exit 2, before the model loads) and in the engine (ConfigError)."""
    from pdcore.server.startup.args_parser import parse_server_args

    with pytest.raises(SystemExit) as e:
        parse_server_args(["--model-path", models[model], "--speculative-algorithm", "NEXTN"])
    assert e.value.code == 2
    assert says in capsys.readouterr().err
    with pytest.raises(ConfigError, match=says):
        _engine(models[model], True)


def test_the_seed_lines_speculative_flags_parse(models):
    from pdcore.server.startup.args_parser import parse_server_args

    for steps in (1, 3):
        args = parse_server_args([
            "--model-path", models["mtp"], "--speculative-algorithm", "NEXTN",
            "--speculative-num-steps", str(steps), "--speculative-eagle-topk", "1",
            "--speculative-num-draft-tokens", str(steps + 1)])
        assert (args.speculative_algorithm, args.speculative_num_steps,
                args.speculative_num_draft_tokens) == ("NEXTN", steps, steps + 1)
