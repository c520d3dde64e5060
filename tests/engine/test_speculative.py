"""Speculative decoding with NGRAM drafts (#33): the drafter, the verify rule, and identity:
greedy output with speculation equals greedy output without it, token for token, and equals
transformers, with chunked prefill, the prefix cache, page sizes 1 and 16, logprobs, stop ids,
n > 1 and TP 2 (grammar-constrained requests beside speculated ones: tests/pd/test_pd_spec.py); sampled output keeps the target
distribution (rejection sampling's acceptance) and repeats with a seed. Every identity test checks that drafts were verified and
accepted, so it cannot pass by never speculating."""

from __future__ import annotations

import pytest
import torch

from pdcore.config import ServerArgs
from pdcore.messages.io import GrammarSpec, SamplingParams
from pdcore.engine.sched.request import Req
from pdcore.engine.sched.sampler import SampleState
from pdcore.engine.sched.speculative import SpecConfig, Speculator, verify
from pdcore.errors import ConfigError
from pdcore.runtime.llm_engine import LLMEngine
from pdcore.testing.greedy import check_greedy, hf_greedy
from pdcore.testing.pages import pages_at_rest
from pdcore.testing.tiny_models import make_tiny_model

VOCAB = 512


def _req(tokens: list[int], greedy: bool = True) -> Req:
    sp = SamplingParams(max_new_tokens=64, temperature=0.0 if greedy else 1.0)
    return Req("r", list(tokens), SampleState.create(sp, tokens))


# ---- the drafter ------------------------------------------------------------------------------

def test_drafts_continue_the_latest_longest_match_of_the_context():
    spec = Speculator(SpecConfig(num_draft_tokens=5, min_window=1, max_window=4))
    # "7 8 9" occurs twice; the last token 9 matches both, "8 9" too; the later match wins
    r = _req([1, 7, 8, 9, 10, 11, 12, 2, 7, 8, 9, 20, 21, 3, 7, 8, 9])
    assert spec.propose(r, budget=10) == [20, 21, 3, 7]
    assert r.drafts == [20, 21, 3, 7]
    assert spec.propose(r, budget=2) == [20, 21]  # bounded by the output budget
    # the longest suffix decides: "5 8 9" matches only the first occurrence
    r2 = _req([5, 8, 9, 40, 41, 6, 8, 9, 50, 51, 5, 8, 9])
    assert spec.propose(r2, budget=10)[:2] == [40, 41]


def test_min_window_and_no_match_give_no_drafts():
    spec = Speculator(SpecConfig(min_window=3))
    assert spec.propose(_req([1, 2, 3, 9, 4, 5, 9]), budget=8) == []  # only "9" matches
    assert Speculator(SpecConfig()).propose(_req([1, 2, 3, 4]), budget=8) == []


def test_penalties_are_not_speculated_and_grammars_are():
    spec = Speculator(SpecConfig())
    r = _req([1, 2, 3, 1, 2, 3, 1, 2])
    r.state.params.grammar = GrammarSpec("regex", "[0-9]+", "regex")
    assert spec.propose(r, budget=8) == [3, 1, 2]  # verified under the grammar's masks
    r = Req("p", [1, 2, 3, 1, 2], SampleState.create(
        SamplingParams(temperature=0.0, repetition_penalty=1.2), [1, 2, 3, 1, 2]))
    assert spec.propose(r, budget=8) == []
    # min_new_tokens: EOS is banned row by row until then; drafts start once it is reached
    # (read from the tokens, not the sampling state, which advances on TP rank 0 only)
    r = Req("m", [1, 2, 3, 1, 2], SampleState.create(
        SamplingParams(temperature=0.0, min_new_tokens=2), [1, 2, 3, 1, 2]))
    assert spec.propose(r, budget=8) == []
    r.output = [3, 1]
    assert spec.propose(r, budget=8) == [2, 3, 1]


def test_cross_request_cache_drafts_for_a_new_request():
    spec = Speculator(SpecConfig(num_draft_tokens=4))
    done = _req([1, 2, 3])
    done.output = [30, 31, 32, 33, 34, 35]
    spec.remember(done)
    fresh = _req([9, 9, 31, 32, 33])  # its own context has no earlier "33"
    assert spec.propose(fresh, budget=8) == [34, 35]
    small = Speculator(SpecConfig(capacity=2))
    small.remember(done)
    assert len(small.cache) == 2


def test_the_gate_drops_drafts_that_would_not_pay_and_tries_again_later():
    spec = Speculator(SpecConfig(num_draft_tokens=4))
    reqs = [_req([1, 2, 3, 1, 2, 3, 1, 2]) for _ in range(4)]
    spec.ratio = 3.0  # a verify costs three decode steps
    for r in reqs:
        spec.propose(r, budget=8)
        r.spec.alpha = 0.1
    spec.select(reqs)
    assert all(r.drafts == [] for r in reqs) and spec.gated == 1
    before = reqs[0].spec.alpha
    spec.select(reqs)
    assert reqs[0].spec.alpha > before  # drifts back toward the prior
    spec.ratio = 1.1  # cheap verifies: good drafts go through
    for r in reqs:
        spec.propose(r, budget=8)
        r.spec.alpha = 0.9
    spec.select(reqs)
    assert all(r.drafts for r in reqs)


def test_measured_ratio_follows_step_times():
    spec = Speculator(SpecConfig())
    for _ in range(20):
        spec.timed(4, 0.010, verify=False)
        spec.timed(4, 0.030, verify=True)
    assert spec.ratio == pytest.approx(3.0, rel=0.05)
    spec.timed(7, 0.5, verify=True)  # no decode time known for batch 7: ignored
    assert spec.ratio == pytest.approx(3.0, rel=0.05)


# ---- the verify rule --------------------------------------------------------------------------

def test_greedy_verify_accepts_the_agreeing_prefix_and_adds_the_target_token():
    rows = torch.full((4, 10), -5.0)
    for j, best in enumerate([3, 4, 7, 1]):
        rows[j, best] = 5.0
    st = SampleState.create(SamplingParams(temperature=0.0), [0])
    toks, lps, err = verify(rows, st, [3, 4, 5], 0)
    assert err is None and toks == [3, 4, 7]  # 5 rejected: the target's 7 instead
    assert len(lps) == 3 and lps[0][1] == 3 and lps[2][1] == 7
    toks, _, _ = verify(rows, st, [3, 4, 7], None)
    assert toks == [3, 4, 7, 1]  # all accepted: the bonus token from the last row


def test_rejection_sampling_keeps_the_target_distribution():
    p = torch.tensor([0.5, 0.3, 0.2])
    rows = torch.log(p).repeat(2, 1)
    counts = torch.zeros(3)
    st = SampleState.create(SamplingParams(temperature=1.0, seed=1), [0])
    n = 6000
    for _ in range(n):
        toks, _, err = verify(rows, st, [2], None)  # always draft the least likely token
        assert err is None
        counts[toks[0]] += 1
    assert torch.allclose(counts / n, p, atol=0.025), counts / n


def test_seeded_sampling_gives_the_same_tokens_whatever_is_drafted():
    """#45 item 9: a seeded sampled request repeats with NGRAM. The verify draws row j's token
    as plain decoding does (one draw from the request's generator per emitted token), so
    drafts that are right, wrong or absent change how many tokens a step emits, never which."""
    model = _model(64)
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=7)
    plain_state = SampleState.create(params, [1])
    plain: list[int] = []
    for _ in range(40):
        plain.append(_choose_plain(model([1, *plain]), plain_state))
    g = torch.Generator().manual_seed(0)
    for mode in ("right", "wrong", "mixed"):
        st = SampleState.create(params, [1])
        out: list[int] = []
        while len(out) < 40:
            k = int(torch.randint(0, 5, (1,), generator=g))
            truth = plain[len(out):len(out) + k]
            wrong = [(t + 1) % 64 for t in truth]
            drafts = {"right": truth, "wrong": wrong,
                      "mixed": truth[:k // 2] + wrong[k // 2:]}[mode]
            rows = torch.stack([model([1, *out, *drafts[:j]]) for j in range(len(drafts) + 1)])
            got, _, err = verify(rows, st, drafts, None)
            assert err is None and got
            out += got
        assert out[:40] == plain, mode


def _choose_plain(logits: torch.Tensor, st: SampleState) -> int:
    from pdcore.engine.sched.sampler import sample

    [t], _, [err] = sample(logits[None].clone(), [st], [None], None)
    assert err is None
    st.observe(t)
    return t


# ---- identity on real engines -----------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("spec") / "m"), vocab_size=VOCAB, seed=5)


def _prompts() -> list[list[int]]:
    """Prompts with repeated stretches (so drafts exist from the start) and one without."""
    g = torch.Generator().manual_seed(3)
    out = []
    for n, reps in ((12, 4), (30, 3), (7, 9), (90, 1)):
        part = torch.randint(3, VOCAB, (n,), generator=g).tolist()
        out.append((part * reps)[: n * reps])
    return out


def _engine(path: str, spec: bool, **kw) -> LLMEngine:
    extra = {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 6} if spec \
        else {}
    return LLMEngine(ServerArgs(model_path=path, max_total_tokens=4096, page_size=kw.pop(
        "page_size", 4), chunked_prefill_size=kw.pop("chunk", 32), **extra, **kw))


def _generate(path: str, spec: bool, prompts, sp: SamplingParams, **kw):
    eng = _engine(path, spec, **kw)
    try:
        outs = eng.generate(prompts, sp, return_logprob=True)
        again = eng.generate(prompts[:2], sp, return_logprob=True)  # from the prefix cache
        assert pages_at_rest(eng.scheduler)
        stats = eng.loop.stats()
    finally:
        eng.close()
    return outs + again, stats


@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_with_speculation_equals_without_and_transformers(tiny, monkeypatch, page_size):
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("PDSERVE_SPEC_GATE", "0")  # verify every draft
    prompts = _prompts()
    sp = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    base, _ = _generate(tiny, False, prompts, sp, page_size=page_size)
    spec, st = _generate(tiny, True, prompts, sp, page_size=page_size)
    assert st["spec_verifies_total"] > 0 and st["spec_accepted_tokens_total"] > 0, st
    assert [o["output_ids"] for o in spec] == [o["output_ids"] for o in base]
    for a, b in zip(spec, base):
        assert [e[1] for e in a["output_logprobs"]] == a["output_ids"]
        got = torch.tensor([e[0] for e in a["output_logprobs"]])
        assert torch.allclose(got, torch.tensor([e[0] for e in b["output_logprobs"]]),
                              atol=1e-3)
    hf = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    verdicts = [check_greedy(o["output_ids"], hf_greedy(hf, p, 40),
                             [e[0] for e in o["output_logprobs"]], logprob_tol=1e-3)
                for p, o in zip(prompts, spec)]
    assert verdicts.count("identical") >= 3, verdicts


def test_stop_ids_length_limits_and_n_samples(tiny, monkeypatch):
    monkeypatch.setenv("PDSERVE_SPEC_GATE", "0")
    prompts = _prompts()[:3]
    free = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    base, _ = _generate(tiny, False, prompts, free)
    stop = base[0]["output_ids"][13]  # a token the first output makes after several steps
    for sp in (SamplingParams(max_new_tokens=40, temperature=0.0, stop_token_ids=[stop]),
               SamplingParams(max_new_tokens=9, temperature=0.0, ignore_eos=True)):
        want, _ = _generate(tiny, False, prompts, sp)
        got, st = _generate(tiny, True, prompts, sp)
        assert st["spec_verifies_total"] > 0
        assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
    # parallel samples (n = 3) of one prompt, greedy: all three equal the plain output
    eng = _engine(tiny, True)
    try:
        outs = eng.generate([prompts[0]] * 3, free)
        assert pages_at_rest(eng.scheduler)
    finally:
        eng.close()
    assert all(o["output_ids"] == base[0]["output_ids"] for o in outs)


def test_sampled_requests_verify_by_rejection_sampling(tiny, monkeypatch):
    monkeypatch.setenv("PDSERVE_SPEC_GATE", "0")
    prompts = _prompts()
    eng = _engine(tiny, True)
    try:
        sampled = eng.generate(prompts, SamplingParams(max_new_tokens=30, temperature=0.8,
                                                       top_p=0.9, seed=4, ignore_eos=True))
        assert all(len(o["output_ids"]) == 30 for o in sampled)
        st = eng.loop.stats()
        assert st["spec_verifies_total"] > 0
        assert pages_at_rest(eng.scheduler)
    finally:
        eng.close()


def test_seeded_sampled_request_repeats_with_ngram(tiny, monkeypatch):
    """#45 item 9, on an engine: the same seeded request alone, again once its output is in the
    cross-request n-gram cache (different drafts), and inside a batch, gives the same tokens;
    equal to an engine without speculation too. Drafts were verified, so it cannot pass by
    never speculating. The engine without speculation computes its logits with other kernels
    (one token a step, not a verify pass): they differ in the last bits, and a draw whose
    uniform falls that close to a boundary between two tokens' cumulative masses picks the
    neighbour (the chance is about the vocabulary size times the logits' difference, per
    token). This seed's tokens fall on no such boundary with either sampler pdserve has had."""
    monkeypatch.setenv("PDSERVE_SPEC_GATE", "0")
    prompts = _prompts()
    sp = SamplingParams(max_new_tokens=30, temperature=0.8, top_p=0.9, seed=12, ignore_eos=True)
    plain = _engine(tiny, False)
    try:
        want = [o["output_ids"] for o in plain.generate(prompts[:2], sp)]
    finally:
        plain.close()
    eng = _engine(tiny, True)
    try:
        alone = [eng.generate([p], sp)[0]["output_ids"] for p in prompts[:2]]
        again = [eng.generate([p], sp)[0]["output_ids"] for p in prompts[:2]]
        batched = [o["output_ids"] for o in eng.generate(prompts, sp)][:2]
        st = eng.loop.stats()
        assert pages_at_rest(eng.scheduler)
    finally:
        eng.close()
    assert st["spec_verifies_total"] > 0 and st["spec_accepted_tokens_total"] > 0, st
    assert alone == again == batched == want


def test_tp2_speculative_greedy_equals_tp1(tiny, monkeypatch):
    monkeypatch.setenv("PDSERVE_SPEC_GATE", "0")
    prompts = _prompts()
    sp = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    base, _ = _generate(tiny, False, prompts, sp)
    got, st = _generate(tiny, True, prompts, sp, tp_size=2)
    assert st["spec_verifies_total"] > 0
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in base]


def test_flags_refuse_what_is_not_built():
    with pytest.raises(ConfigError, match="STANDALONE is not built"):
        ServerArgs(speculative_algorithm="STANDALONE").validate()
    with pytest.raises(ConfigError, match="EAGLE3: needs --speculative-draft-model-path"):
        ServerArgs(speculative_algorithm="EAGLE3").validate()  # built: test_speculative_eagle3
    with pytest.raises(ConfigError, match="NGRAM runs no draft model"):
        ServerArgs(speculative_algorithm="NGRAM",
                   speculative_draft_model_path="/x").validate()
    with pytest.raises(ConfigError, match="num-draft-tokens"):
        ServerArgs(speculative_algorithm="ngram", speculative_num_draft_tokens=0).validate()
    ok = ServerArgs(speculative_algorithm="ngram")
    ok.validate()
    assert ok.speculative_algorithm == "NGRAM" and ok.speculative_num_draft_tokens == 8


# ---- jump-forward: a grammar's forced tokens as drafts -------------------------------------------

def _model(vocab: int):
    """A deterministic stand-in for a model: logits that depend on the whole prefix."""
    def logits(prefix: list[int]) -> torch.Tensor:
        g = torch.Generator().manual_seed(hash(tuple(prefix)) & 0x7FFFFFFF)
        return torch.randn(vocab, generator=g) * 4
    return logits


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_jump_forward_drafts_verified_under_the_grammar_equal_plain_decoding(temperature):
    """Constrained decoding one token at a time vs with the grammar's jump-forward tokens as
    drafts, verified row by row under the matcher's masks: greedy gives the same tokens;
    sampled output follows the grammar (and verify never accepts a token the mask forbids)."""
    import json
    from types import SimpleNamespace

    pytest.importorskip("xgrammar", reason="xgrammar is one of pdcore's dependencies")
    from pdcore.engine.model.tokenizer import default_model_file, load_tokenizer
    from pdcore.constrained.backend import GrammarBackend
    from pdcore.engine.sched.sampler import sample

    tok = load_tokenizer(SimpleNamespace(model_path=default_model_file()))
    backend = GrammarBackend("xgrammar", lambda: tok, len(tok), [tok.eos_token_id],
                             any_whitespace=False)
    schema = {"type": "object", "properties": {
        "customer_identifier": {"type": "integer"}, "shipping_priority": {"enum": ["low", "high"]},
        "is_gift_wrapped": {"type": "boolean"}},
        "required": ["customer_identifier", "shipping_priority", "is_gift_wrapped"],
        "additionalProperties": False}
    spec = GrammarSpec("json_schema", json.dumps(schema))
    model = _model(len(tok))
    params = SamplingParams(temperature=temperature, seed=3, grammar=spec, max_new_tokens=80)

    plain_state = SampleState.create(params, [1])
    plain: list[int] = []
    while not plain_state.grammar_done and len(plain) < 80:
        [t], _, [err] = sample(model([1, *plain])[None], [plain_state], [None], backend)
        assert err is None
        plain.append(t)

    st = SampleState.create(params, [1])
    out: list[int] = []
    forced = accepted = 0
    while not st.grammar_done and len(out) < 80:
        drafts = st.constraint.jump_tokens()[:7] if st.constraint is not None else []
        rows = torch.stack([model([1, *out, *drafts[:j]]) for j in range(len(drafts) + 1)])
        got, _, err = verify(rows, st, drafts, None, backend)
        assert err is None and got
        forced += len(drafts)
        accepted += sum(1 for a, b in zip(got, drafts) if a == b)
        out += got
    assert forced > 0, "the schema's keys never produced jump-forward tokens"
    text = tok.decode(out, skip_special_tokens=True)
    assert set(json.loads(text)) == set(schema["properties"]), text
    if temperature == 0.0:
        assert out == plain


def test_jump_forward_in_the_engine_equals_one_token_per_step(monkeypatch, tmp_path):
    """Whole engines, constrained requests in one batch: with jump-forward the output ids,
    finish reasons and text equal one token per step's, including outputs whose last verify
    holds both the grammar's closing tokens and the stop token (the grammar's end belongs to
    the last token of a verify, not to the first)."""
    import json

    pytest.importorskip("xgrammar", reason="xgrammar is one of pdcore's dependencies")
    from pdcore.engine.model.tokenizer import default_model_file, load_tokenizer

    model = make_tiny_model(str(tmp_path / "jf"), seed=11, tokenizer_from=default_model_file())
    tok = load_tokenizer(ServerArgs(model_path=model))
    level = {"type": "object", "properties": {
        "ok": {"type": "boolean"}, "level": {"enum": ["low", "mid", "high"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 500}},
        "required": ["ok", "level", "n"], "additionalProperties": False}
    nested = {"type": "object", "properties": {  # this model closes it with "}}" then EOS
        "f0": {"enum": ["x", "y", "z"]}, "f1": {"enum": [1, 2, 3]}, "sub": level},
        "required": ["f0", "f1", "sub"], "additionalProperties": False}
    schemas = [level, nested, {"type": "array", "items": level, "minItems": 2, "maxItems": 2}]
    specs = [GrammarSpec("json_schema", json.dumps(s)) for s in schemas] + [
        GrammarSpec("regex", r"(red|green|blue)-[0-9]{2,4}")]
    chat = tok.apply_chat_template([{"role": "user", "content": "Answer in the requested "
                                     "format."}], add_generation_prompt=True, tokenize=False)
    prompts = [tok(chat)["input_ids"]] * len(specs)
    outs = {}
    monkeypatch.setenv("PDSERVE_SPEC_GATE", "0")  # every draft verified, whatever the timing
    for jf in ("0", "1"):
        monkeypatch.setenv("PDSERVE_JUMP_FORWARD", jf)
        eng = LLMEngine(ServerArgs(model_path=model, max_total_tokens=4096,
                                   constrained_json_disable_any_whitespace=True))
        try:
            outs[jf] = eng.generate(prompts, [SamplingParams(
                max_new_tokens=160, temperature=0.0, grammar=s) for s in specs])
            st = eng.loop.stats()
            assert pages_at_rest(eng.scheduler)
        finally:
            eng.close()
        if jf == "1":
            assert st["spec_jump_forward_tokens_total"] > 0, st
    for a, b in zip(outs["0"], outs["1"]):
        assert a["output_ids"] == b["output_ids"]
        assert a["finish_reason"] == b["finish_reason"]
        assert a["finish_reason"]["type"] == "stop", a
