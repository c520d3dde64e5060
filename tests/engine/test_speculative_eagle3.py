"""EAGLE3 speculative decoding (#33, chain drafts, topk 1): capture, identity, the accept path.

- the target's captured hidden states (the residual streams entering three layers,
  concatenated) equal transformers' hidden_states at those layers, and the logits are those of
  a step that captures nothing;
- a random EAGLE-3 head beside a tiny random 8-layer Llama (SGLang's default layers 2, 4, 5;
  and eagle_config layer ids [0, 3, 7] -> layers 1, 4 and the stream after the last): greedy
  output with EAGLE3 equals greedy without it and transformers', at page sizes 1 and 4, batch 1
  and 3, chunked prefill; every page comes back; the drafts are target-vocabulary ids (the
  draft vocabulary mapped through d2t);
- the drafter's incremental drafts equal the head run from scratch over the whole sequence;
- a head that agrees with its target (a target that always predicts one token, a head that
  always drafts it from its draft vocabulary): nearly every draft is accepted;
- bad heads: ModelLoadError naming what is wrong (engine) and exit 2 at the command line.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from pdcore.config import ServerArgs
from pdcore.messages.io import SamplingParams
from pdcore.engine.model.batch import ForwardBatch, SeqSpan
from pdcore.engine.model.layers import linear
from pdcore.errors import ConfigError, ModelLoadError
from pdcore.runtime.llm_engine import LLMEngine
from pdcore.testing.greedy import check_greedy, hf_greedy
from pdcore.testing.pages import pages_at_rest
from pdcore.testing.tiny_models import make_eagle3_head, make_tiny_model

VOCAB, HIDDEN, HEADS, KV_HEADS, LAYERS, DRAFT_VOCAB = 512, 64, 4, 2, 8, 128
AGREE = 300  # the token the constant target always predicts


def head(path: str, **kw) -> str:
    return make_eagle3_head(path, vocab=VOCAB, hidden=HIDDEN, heads=HEADS, kv_heads=KV_HEADS,
                            **kw)


def make_constant_target(path: str) -> str:
    """A tiny Llama whose layers add nothing (o_proj, down_proj zero), every embedding large on
    feature 0 and lm_head row AGREE large there: it predicts AGREE after every token."""
    from safetensors.torch import load_file, save_file

    make_tiny_model(path, vocab_size=VOCAB, seed=9, layers=LAYERS)
    f = os.path.join(path, "model.safetensors")
    sd = load_file(f)
    for k in sd:
        if k.endswith(("o_proj.weight", "down_proj.weight")):
            sd[k] = torch.zeros_like(sd[k])
    sd["model.embed_tokens.weight"][:, 0] = 10.0
    sd["lm_head.weight"][:, 0] = torch.rand(VOCAB) - 0.5
    sd["lm_head.weight"][AGREE, 0] = 5.0
    save_file(sd, f, metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3")
    return {
        "target": make_tiny_model(str(root / "t"), vocab_size=VOCAB, seed=5, layers=LAYERS),
        "head": head(str(root / "h"), seed=1, draft_vocab=DRAFT_VOCAB),
        "head_ids": head(str(root / "hi"), seed=2, layer_ids=[0, 3, 7], fc_bias=True),
        "constant": make_constant_target(str(root / "c")),
        "agree": head(str(root / "a"), seed=3, draft_vocab=DRAFT_VOCAB, agree_token=AGREE),
    }


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (12, 45, 7)]


def _engine(target: str, head_dir: str | None, steps: int = 3, **kw) -> LLMEngine:
    extra = {"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": head_dir,
             "speculative_num_steps": steps, "speculative_eagle_topk": 1,
             "speculative_num_draft_tokens": steps + 1} if head_dir else {}
    return LLMEngine(ServerArgs(model_path=target, max_total_tokens=4096,
                                page_size=kw.pop("page_size", 4),
                                chunked_prefill_size=kw.pop("chunk", 16), **extra, **kw))


def _generate(target: str, head_dir: str | None, prompts, sp: SamplingParams, **kw):
    """Outputs of `prompts` then the first two again (prefix cache), the stats and every
    chain's drafts."""
    eng = _engine(target, head_dir, **kw)
    drafts: list[int] = []
    hot = None
    if head_dir:
        drafter = eng.loop.spec.drafter
        assert eng.loop.runner.model_runner.capture_layers == drafter.head.aux_layers
        hot = drafter.head.hot
        propose = drafter.propose

        def record(reqs, wants):
            out = propose(reqs, wants)
            drafts.extend(t for d in out for t in d)
            return out

        drafter.propose = record
    try:
        outs = eng.generate(prompts, sp, return_logprob=True)
        again = eng.generate(prompts[:2], sp, return_logprob=True)
        assert pages_at_rest(eng.scheduler)
        stats = eng.loop.stats().as_dict()
        assert not head_dir or eng.loop.spec.drafter.failures == 0
        model = eng.loop.runner.model
        native = (model.native is not None, model.native_steps)
    finally:
        eng.close()
    return outs + again, {**stats, "drafts": drafts, "hot": hot, "native": native}


def test_captured_hidden_states_are_transformers_hidden_states(models):
    from transformers import AutoModelForCausalLM

    eng = _engine(models["target"], None)
    try:
        model = eng.loop.runner.model
        ids = _prompts()[1]
        n = len(ids)

        def run(extra: dict) -> tuple[torch.Tensor, ForwardBatch]:
            a = model.layers[0].self_attn
            kv = [(torch.zeros(n, 1, a.num_kv_heads, a.head_dim),
                   torch.zeros(n, 1, a.num_kv_heads, a.head_dim)) for _ in model.layers]
            b = ForwardBatch(torch.tensor(ids), torch.arange(n), torch.arange(n),
                             [SeqSpan(0, n, torch.arange(n))], torch.arange(n))
            for k, v in extra.items():
                setattr(b, k, v)
            return model(b, kv), b

        plain, _ = run({})
        logits, b = run({"capture_layers": (2, 4, LAYERS)})
        assert torch.equal(logits, plain)
        got = b.hidden
        assert got.shape == (n, 3 * HIDDEN)
        # index L: the stream after the last layer, what the final norm and lm_head read
        last = linear(model.norm(got[:, 2 * HIDDEN :]), model.lm_head, None,
                      model.lm_head_packed).float()
        torch.testing.assert_close(last, plain, atol=1e-5, rtol=1e-5)
    finally:
        eng.close()
    hf = AutoModelForCausalLM.from_pretrained(models["target"], dtype=torch.float32).eval()
    with torch.inference_mode():
        hs = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    # transformers' hidden_states[i] (i < L): the stream entering layer i
    torch.testing.assert_close(got[:, :HIDDEN], hs[2][0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[:, HIDDEN : 2 * HIDDEN], hs[4][0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name,page_size,batch", [("head", 1, 3), ("head", 4, 1),
                                                  ("head_ids", 4, 3)])
def test_greedy_with_eagle3_equals_without_and_transformers(models, monkeypatch, name,
                                                             page_size, batch):
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("PDSERVE_SPEC_GATE", "0")  # verify every draft
    prompts = _prompts()[:batch]
    sp = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    base, bst = _generate(models["target"], None, prompts, sp, page_size=page_size)
    got, st = _generate(models["target"], models[name], prompts, sp, page_size=page_size)
    # the native decode loop: plain decode steps where it is built (a lone request's too,
    # #48); none under EAGLE3 (each step captures three layers: the Python loop)
    assert st["native"][1] == 0, st["native"]
    assert (bst["native"][1] > 0) == bst["native"][0], bst["native"]
    assert st["spec_verifies_total"] > 0 and st["spec_draft_tokens_total"] > 0, st
    assert st["spec_draft_passes_total"] > 0 and st["spec_draft_failures_total"] == 0, st
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in base]
    assert st["drafts"] and all(0 <= t < VOCAB for t in st["drafts"])
    if st["hot"] is not None:  # a draft vocabulary: its ids mapped to the target's
        hot = set(st["hot"].tolist())
        assert all(t in hot for t in st["drafts"]), st["drafts"]
        assert max(st["drafts"]) >= DRAFT_VOCAB  # target ids, not the draft vocabulary's
    hf = AutoModelForCausalLM.from_pretrained(models["target"], dtype=torch.float32).eval()
    verdicts = [check_greedy(o["output_ids"], hf_greedy(hf, p, 24),
                             [e[0] for e in o["output_logprobs"]], logprob_tol=1e-3)
                for p, o in zip(prompts, got)]
    assert verdicts.count("identical") >= len(prompts) - 1, verdicts


def _reference_drafts(target, head_mod, tokens: list[int], c: int, k: int) -> list[int]:
    """k drafts after `tokens` (c = len(tokens) - 1 positions computed), from scratch: the
    target's captured states over the whole sequence, the head over every real pair in one
    pass (fresh K/V), then the chain one position at a time on its own outputs."""
    def pool(heads: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(c + k, 1, heads, dim), torch.zeros(c + k, 1, heads, dim)

    def batch(ids: list[int], at: int) -> ForwardBatch:
        n = len(ids)
        pos = torch.arange(at, at + n)
        return ForwardBatch(torch.tensor(ids), pos, pos, [SeqSpan(0, n, torch.arange(at + n))],
                            torch.empty(0, dtype=torch.long))

    a = target.layers[0].self_attn
    b = batch(tokens[:c], 0)
    b.capture_layers = head_mod.aux_layers
    target(b, [pool(a.num_kv_heads, a.head_dim) for _ in target.layers], logits=False)
    kc, vc = pool(head_mod.kv_heads, head_mod.head_dim)
    g = head_mod(batch(tokens[1 : c + 1], 0), b.hidden, kc, vc)[-1:]
    out = [int(head_mod.logits(g).argmax())]
    for j in range(1, k):
        g = head_mod(batch([out[-1]], c + j - 1), g, kc, vc)
        out.append(int(head_mod.logits(g).argmax()))
    return out


def test_incremental_drafts_equal_the_head_run_from_scratch(models, monkeypatch):
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


def test_a_head_that_agrees_with_its_target_gets_its_drafts_accepted(models, monkeypatch):
    monkeypatch.setenv("PDSERVE_SPEC_GATE", "0")
    prompts = _prompts()
    sp = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    base, _ = _generate(models["constant"], None, prompts, sp)
    got, st = _generate(models["constant"], models["agree"], prompts, sp, steps=4)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in base]
    assert all(o["output_ids"] == [AGREE] * 40 for o in got)
    assert set(st["drafts"]) == {AGREE}  # draft id hot.index(AGREE) != AGREE, mapped
    assert st["spec_accept_rate"] > 0.9, st
    assert st["spec_accept_length"] > 4.0, st


def _broken(models, tmp_path, name: str, edit) -> str:
    """A copy of the random head with `edit(state dict, config)` applied."""
    from safetensors.torch import load_file, save_file

    d = str(tmp_path / name)
    shutil.copytree(models["head"], d)
    sd = load_file(os.path.join(d, "model.safetensors"))
    with open(os.path.join(d, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    edit(sd, cfg)
    save_file({k: v.contiguous() for k, v in sd.items()}, os.path.join(d, "model.safetensors"))
    with open(os.path.join(d, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f)
    return d


def test_bad_heads_are_refused_with_a_message(models, tmp_path):
    from pdcore.engine.model.eagle3 import load_eagle3_head

    def d2t_out(sd, cfg):
        sd["d2t"] = sd["d2t"] + VOCAB

    cases = {
        "no_norm": (lambda sd, cfg: sd.pop("midlayer.hidden_norm.weight"),
                    "lacks the weight 'midlayer.hidden_norm.weight'"),
        "fc": (lambda sd, cfg: sd.update({"fc.weight": sd["fc.weight"][:, :HIDDEN * 2]}),
               r"'fc.weight' has shape \(64, 128\), expected \(64, 192\)"),
        "qkv": (lambda sd, cfg: sd.update({"midlayer.self_attn.q_proj.weight": torch.zeros(
            HIDDEN, HIDDEN)}), "q_proj.weight' has shape"),
        "d2t": (d2t_out, "d2t maps draft ids outside"),
        "no_d2t": (lambda sd, cfg: sd.pop("d2t"), "needs the d2t map"),
        "ids": (lambda sd, cfg: cfg.update(eagle_config={
            "eagle_aux_hidden_state_layer_ids": [1, 1, 5]}), "3 distinct layers"),
        "far": (lambda sd, cfg: cfg.update(eagle_config={
            "eagle_aux_hidden_state_layer_ids": [1, 4, 8]}), r"in \[0, 8\]"),
        "aux": (lambda sd, cfg: cfg.update(eagle_config={"use_aux_hidden_state": False}),
                "use_aux_hidden_state false"),
        "wide": (lambda sd, cfg: cfg.update(hidden_size=2 * HIDDEN), "hidden size 128"),
        "vocab": (lambda sd, cfg: cfg.update(draft_vocab_size=VOCAB + 1), "draft_vocab_size"),
        "arch": (lambda sd, cfg: cfg.update(architectures=["LlamaForCausalLMEagle"]),
                 "LlamaForCausalLMEagle3"),
    }
    eng = _engine(models["target"], None)
    try:
        target = eng.loop.runner.model
        for name, (edit, says) in cases.items():
            with pytest.raises(ModelLoadError, match=says):
                load_eagle3_head(_broken(models, tmp_path, name, edit), target, torch.float32,
                                 torch.device("cpu"))
    finally:
        eng.close()
    # the engine's start raises it too
    with pytest.raises(ModelLoadError, match="d2t maps"):
        _engine(models["target"], str(tmp_path / "d2t"))


def test_the_command_line_refuses_bad_heads_with_exit_2(models, tmp_path, capsys):
    from pdcore.server.startup.args_parser import parse_server_args

    two = _broken(models, tmp_path, "two", lambda sd, cfg: cfg.update(num_hidden_layers=2))
    one = _broken(models, tmp_path, "one", lambda sd, cfg: cfg.update(
        architectures=["LlamaForCausalLMEagle"]))
    for folder, says in ((two, "only one-layer EAGLE-3 heads"), (one, "not LlamaForCausalLM"),
                         (str(tmp_path / "none"), "does not exist"), (None,
                          "needs --speculative-draft-model-path")):
        argv = ["--model-path", models["target"], "--speculative-algorithm", "EAGLE3"]
        with pytest.raises(SystemExit) as e:
            parse_server_args(argv + (["--speculative-draft-model-path", folder]
                                      if folder else []))
        assert e.value.code == 2
        assert says in capsys.readouterr().err
    args = parse_server_args(["--model-path", models["target"], "--speculative-algorithm",
                              "eagle3", "--speculative-draft-model-path", models["head"]])
    assert (args.speculative_algorithm, args.speculative_num_steps,
            args.speculative_num_draft_tokens) == ("EAGLE3", 3, 4)


def test_flags():
    with pytest.raises(ConfigError, match="EAGLE3: needs --speculative-draft-model-path"):
        ServerArgs(speculative_algorithm="EAGLE3").validate()
    with pytest.raises(ConfigError, match="topk 2: only 1"):
        ServerArgs(speculative_algorithm="EAGLE3", speculative_draft_model_path="/x",
                   speculative_eagle_topk=2).validate()
    with pytest.raises(ConfigError, match="--enable-multi-layer-eagle"):
        ServerArgs(speculative_algorithm="EAGLE3", speculative_draft_model_path="/x",
                   enable_multi_layer_eagle=True).validate()
    ServerArgs(speculative_algorithm="EAGLE3", speculative_draft_model_path="/x",
               disaggregation_mode="prefill").validate()
    ServerArgs(speculative_algorithm="EAGLE3", speculative_draft_model_path="/x",
               tp_size=2).validate()


@pytest.mark.heavy  # a TP process tree
def test_tp2_eagle3_greedy_equals_tp1_plain(tmp_path, monkeypatch):
    """The head's layer sharded as the target's (3 KV heads: 1 + 2 on two ranks; q/k/v over
    its 2 * hidden inputs whole on both), every rank captures and runs every pass."""
    monkeypatch.setenv("PDSERVE_SPEC_GATE", "0")
    shape = {"hidden": 96, "heads": 6, "kv_heads": 3}
    target = make_tiny_model(str(tmp_path / "t"), vocab_size=VOCAB, seed=5, layers=LAYERS,
                             **shape)
    head_dir = make_eagle3_head(str(tmp_path / "h"), vocab=VOCAB, seed=1,
                                draft_vocab=DRAFT_VOCAB, **shape)
    prompts = _prompts()
    sp = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)
    outs = {}
    for tp, spec in ((1, None), (2, head_dir)):
        eng = _engine(target, spec, tp_size=tp)
        try:
            outs[tp] = [o["output_ids"] for o in eng.generate(prompts, sp)]
            assert pages_at_rest(eng.scheduler)
            if spec:
                st = eng.loop.stats().as_dict()
                assert st["spec_verifies_total"] > 0, st
                assert eng.loop.spec.drafter.failures == 0
                assert eng.loop.spec.drafter.k.shape[2] == 1  # rank 0's KV head
        finally:
            eng.close()
    assert outs[2] == outs[1]


def test_which_target_layers_the_head_reads():
    """SGLang's rule: eagle_config ids + 1 (the stream entering the layer after each), else
    layers 2, L // 2, L - 3; in layer order."""
    from types import SimpleNamespace

    from pdcore.engine.model.eagle3 import aux_layers

    assert aux_layers(SimpleNamespace(), 32, "x") == (2, 16, 29)
    ids = SimpleNamespace(eagle_config={"eagle_aux_hidden_state_layer_ids": [7, 0, 3]})
    assert aux_layers(ids, 8, "x") == (1, 4, 8)
    with pytest.raises(ModelLoadError, match="3 distinct layers"):
        aux_layers(SimpleNamespace(), 4, "x")  # [2, 2, 1]
