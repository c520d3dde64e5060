"""EAGLE speculative decoding (#33, chain drafts): identity and the accept path.

- a random EAGLE-1 head beside a tiny random Llama: greedy output with EAGLE equals greedy
  without it and transformers', token for token, at batch 1 and 4, with the prefix cache,
  page sizes 1 and 16, logprobs, stop ids, length limits and repeated prompts (n > 1);
- the drafter's incremental drafts (draft K/V written after every target step into the
  request's own pages, the chain on scratch slots) equal the head run from scratch over the
  whole sequence;
- a head built to agree with its target (a target whose next token depends on the current one
  alone, and a head that reads the token only): nearly every draft is accepted, and the
  counters (spec_verify_ct, accepted tokens, accept length) show it;
- flags: EAGLE needs a head folder and refuses topk > 1 (PD mode and TP > 1 are accepted:
  tests/engine/test_speculative_tp.py; DP attention: tests/engine/test_speculative_dp.py, in PD
  mode tests/pd/test_pd_spec_dp.py).
"""

from __future__ import annotations

import os

import pytest
import torch

from pdcore.config import ServerArgs
from pdcore.messages.io import SamplingParams
from pdcore.errors import ConfigError
from pdcore.runtime.llm_engine import LLMEngine
from pdcore.testing.greedy import check_greedy, hf_greedy
from pdcore.testing.pages import pages_at_rest
from pdcore.testing.tiny_models import make_eagle_head as make_head
from pdcore.testing.tiny_models import make_tiny_model

VOCAB, HIDDEN, HEADS, KV_HEADS = 512, 64, 4, 2


def make_eagle_head(path: str, seed: int = 0, own_embed: bool = False,
                    perfect: bool = False) -> str:
    return make_head(path, vocab=VOCAB, hidden=HIDDEN, heads=HEADS, kv_heads=KV_HEADS,
                     seed=seed, own_embed=own_embed, perfect=perfect)


def make_bigram_target(path: str) -> str:
    """A tiny Llama whose layers add nothing (o_proj and down_proj zero): its next token is
    argmax lm_head(norm(embedding(token))), a function of the current token alone."""
    from safetensors.torch import load_file, save_file

    make_tiny_model(path, vocab_size=VOCAB, seed=9)
    f = os.path.join(path, "model.safetensors")
    sd = load_file(f)
    for k in sd:
        if k.endswith(("o_proj.weight", "down_proj.weight")):
            sd[k] = torch.zeros_like(sd[k])
    save_file(sd, f, metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle")
    return {
        "target": make_tiny_model(str(root / "t"), vocab_size=VOCAB, seed=5),
        "head": make_eagle_head(str(root / "h"), seed=1),
        "head_embed": make_eagle_head(str(root / "he"), seed=2, own_embed=True),
        "bigram": make_bigram_target(str(root / "b")),
        "perfect": make_eagle_head(str(root / "p"), seed=3, perfect=True),
    }


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (12, 45, 7, 90)]


def _engine(target: str, head: str | None, steps: int = 3, **kw) -> LLMEngine:
    extra = {"speculative_algorithm": "EAGLE", "speculative_draft_model_path": head,
             "speculative_num_steps": steps, "speculative_eagle_topk": 1,
             "speculative_num_draft_tokens": steps + 1} if head else {}
    return LLMEngine(ServerArgs(model_path=target, max_total_tokens=4096,
                                page_size=kw.pop("page_size", 4),
                                chunked_prefill_size=kw.pop("chunk", 32), **extra, **kw))


def _generate(target: str, head: str | None, prompts, sp: SamplingParams, **kw):
    """Outputs of `prompts` then of the first two again (from the prefix cache), the stats,
    with each request's spec_verify_ct (what meta_info reports) under "verify_ct"."""
    eng = _engine(target, head, **kw)
    verify_ct: dict[str, int] = {}
    if head:
        spec = eng.loop.spec
        booked = spec.verified

        def verified(req, drafts, tokens):
            booked(req, drafts, tokens)
            verify_ct[req.rid] = req.spec.verify_ct

        spec.verified = verified
    try:
        outs = eng.generate(prompts, sp, return_logprob=True)
        again = eng.generate(prompts[:2], sp, return_logprob=True)  # from the prefix cache
        assert pages_at_rest(eng.scheduler)
        stats = eng.loop.stats()
        assert not head or eng.loop.spec.drafter.failures == 0
    finally:
        eng.close()
    return outs + again, {**stats.as_dict(), "verify_ct": verify_ct}


@pytest.mark.parametrize("page_size,batch", [(1, 4), (16, 4), (4, 1)])
def test_greedy_with_eagle_equals_without_and_transformers(models, monkeypatch, page_size,
                                                            batch):
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("PDSERVE_SPEC_GATE", "0")  # verify every draft
    prompts = _prompts()[:batch]
    sp = SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True)
    base, _ = _generate(models["target"], None, prompts, sp, page_size=page_size)
    got, st = _generate(models["target"], models["head"], prompts, sp, page_size=page_size)
    assert st["spec_verifies_total"] > 0 and st["spec_draft_tokens_total"] > 0, st
    assert st["spec_draft_passes_total"] > 0 and st["spec_draft_failures_total"] == 0, st
    assert len(st["verify_ct"]) == len(got) and min(st["verify_ct"].values()) > 0
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in base]
    for a, b in zip(got, base):
        assert [e[1] for e in a["output_logprobs"]] == a["output_ids"]
        assert torch.allclose(torch.tensor([e[0] for e in a["output_logprobs"]]),
                              torch.tensor([e[0] for e in b["output_logprobs"]]), atol=1e-3)
    hf = AutoModelForCausalLM.from_pretrained(models["target"], dtype=torch.float32).eval()
    verdicts = [check_greedy(o["output_ids"], hf_greedy(hf, p, 30),
                             [e[0] for e in o["output_logprobs"]], logprob_tol=1e-3)
                for p, o in zip(prompts, got)]
    assert verdicts.count("identical") >= len(prompts) - 1, verdicts


def test_stop_ids_length_limits_repeats_and_an_own_embedding(models, monkeypatch):
    monkeypatch.setenv("PDSERVE_SPEC_GATE", "0")
    prompts = _prompts()[:3]
    free = SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True)
    base, _ = _generate(models["target"], None, prompts, free)
    stop = base[0]["output_ids"][11]
    for sp in (SamplingParams(max_new_tokens=30, temperature=0.0, stop_token_ids=[stop]),
               SamplingParams(max_new_tokens=7, temperature=0.0, ignore_eos=True)):
        want, _ = _generate(models["target"], None, prompts, sp)
        got, st = _generate(models["target"], models["head_embed"], prompts, sp, steps=5)
        assert st["spec_verifies_total"] > 0
        assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
    # the same prompt three times in one batch (what n = 3 sends), greedy: all equal plain
    eng = _engine(models["target"], models["head"])
    try:
        outs = eng.generate([prompts[0]] * 3, free)
        assert pages_at_rest(eng.scheduler)
    finally:
        eng.close()
    assert all(o["output_ids"] == base[0]["output_ids"] for o in outs)


def _reference_drafts(target, head, tokens: list[int], c: int, k: int) -> list[int]:
    """k drafts after `tokens` (c = len(tokens) - 1 positions computed), everything from
    scratch: the target's hidden states over the whole sequence, then each chain step runs
    the head over every pair again (fresh K/V each time)."""
    from pdcore.engine.model.batch import ForwardBatch, SeqSpan

    def pool(heads: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(c + k, 1, heads, dim), torch.zeros(c + k, 1, heads, dim)

    def batch(ids: list[int]) -> ForwardBatch:
        n = len(ids)
        return ForwardBatch(torch.tensor(ids), torch.arange(n), torch.arange(n),
                            [SeqSpan(0, n, torch.arange(n))], torch.empty(0, dtype=torch.long))

    a = target.layers[0].self_attn
    b = batch(tokens[:c])
    b.capture_hidden = True
    target(b, [pool(a.num_kv_heads, a.head_dim) for _ in target.layers], logits=False)
    feats, ids, out = list(b.hidden), tokens[1 : c + 1], []
    for _ in range(k):
        g = head(batch(ids), torch.stack(feats), *pool(head.kv_heads, head.head_dim))
        out.append(int(head.logits(g[-1:]).argmax()))
        feats.append(g[-1])
        ids = ids + [out[-1]]
    return out


def test_incremental_drafts_equal_the_head_run_from_scratch(models, monkeypatch):
    """Draft K/V written step by step into the requests' pages (chunked prefill, the prefix
    cache, verifies that reject) and chains on scratch slots give the drafts that running
    the head over the whole sequence gives."""
    monkeypatch.setenv("PDSERVE_SPEC_GATE", "0")
    eng = _engine(models["target"], models["head"], steps=4, chunk=16)
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
        eng.generate(prompts + [prompts[1][:30] + [7, 8]],
                     SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True))
        target = eng.loop.runner.model
        assert len(seen) > 10 and any(len(d) == 4 for _, _, d in seen)
        for tokens, c, drafts in seen[::3]:
            assert len(tokens) == c + 1
            assert drafts == _reference_drafts(target, drafter.head, tokens, c, len(drafts))
    finally:
        eng.close()


def test_sampled_requests_with_eagle(models, monkeypatch):
    monkeypatch.setenv("PDSERVE_SPEC_GATE", "0")
    eng = _engine(models["target"], models["head"])
    try:
        outs = eng.generate(_prompts(), SamplingParams(max_new_tokens=20, temperature=0.8,
                                                       top_p=0.9, seed=4, ignore_eos=True))
        assert all(len(o["output_ids"]) == 20 for o in outs)
        assert eng.loop.stats()["spec_verifies_total"] > 0
        assert pages_at_rest(eng.scheduler)
    finally:
        eng.close()


def test_a_head_that_agrees_with_its_target_gets_its_drafts_accepted(models, monkeypatch):
    monkeypatch.setenv("PDSERVE_SPEC_GATE", "0")
    prompts = _prompts()
    sp = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    base, _ = _generate(models["bigram"], None, prompts, sp)
    got, st = _generate(models["bigram"], models["perfect"], prompts, sp, steps=4)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in base]
    assert st["spec_accept_rate"] > 0.9, st
    assert st["spec_accept_length"] > 4.0, st  # 4 drafts + the target's own token per verify
    # 40 tokens each in far fewer verify passes than tokens
    cts = list(st["verify_ct"].values())
    assert len(cts) == len(got) and all(0 < c <= 12 for c in cts), cts


def test_flags():
    with pytest.raises(ConfigError, match="needs --speculative-draft-model-path"):
        ServerArgs(speculative_algorithm="EAGLE").validate()
    with pytest.raises(ConfigError, match="topk 2: only 1"):
        ServerArgs(speculative_algorithm="EAGLE", speculative_draft_model_path="/x",
                   speculative_eagle_topk=2).validate()
    ServerArgs(speculative_algorithm="EAGLE", speculative_draft_model_path="/x",
               disaggregation_mode="decode").validate()  # PD: tests/pd/test_pd_eagle.py
    ServerArgs(speculative_algorithm="EAGLE", speculative_draft_model_path="/x",
               tp_size=2).validate()  # TP: tests/engine/test_speculative_tp.py
    ServerArgs(speculative_algorithm="EAGLE", speculative_draft_model_path="/x", tp_size=2,
               dp_size=2, enable_dp_attention=True).validate()  # test_speculative_dp.py
    ServerArgs(speculative_algorithm="EAGLE", speculative_draft_model_path="/x",
               tp_size=2, dp_size=2, enable_dp_attention=True,
               disaggregation_mode="prefill").validate()  # tests/pd/test_pd_spec_dp.py
    ServerArgs(speculative_algorithm="EAGLE", speculative_draft_model_path="/x",
               speculative_draft_model_quantization="unquant").validate()  # the head's way
    ServerArgs(speculative_algorithm="EAGLE", speculative_draft_model_path="/x",
               speculative_draft_model_quantization="fp8").validate()  # checked on its files
    with pytest.raises(ConfigError, match="quantization int3: not a quantization method"):
        ServerArgs(speculative_algorithm="EAGLE", speculative_draft_model_path="/x",
                   speculative_draft_model_quantization="int3").validate()
    with pytest.raises(ConfigError, match="must be 5"):
        ServerArgs(speculative_algorithm="EAGLE", speculative_draft_model_path="/x",
                   speculative_num_steps=4, speculative_num_draft_tokens=3).validate()
    ok = ServerArgs(speculative_algorithm="eagle", speculative_draft_model_path="/x")
    ok.validate()
    assert (ok.speculative_num_steps, ok.speculative_eagle_topk,
            ok.speculative_num_draft_tokens) == (3, 1, 4)
    ngram_pd = ServerArgs(speculative_algorithm="NGRAM", disaggregation_mode="decode")
    ngram_pd.validate()  # NGRAM in PD stays
