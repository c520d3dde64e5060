"""Multi-layer MTP drafting (#33, `--enable-multi-layer-eagle`): a MiMo checkpoint's own N MTP
layers draft chains, step j with layer min(j, N - 1), each layer over its own K/V pool.

- a tiny random MiMo (Qwen2 body + N MTP layers written into its safetensors): greedy output
  with multi-layer EAGLE / NEXTN equals greedy without drafts and transformers' Qwen2 holding
  the same body, at page sizes 1 and 4, batch 1 and 3, chunked prefill, chains shorter and
  longer than N, rerun from the prefix cache, every page free at the end;
- the drafter's incremental drafts (each layer's K/V written after every target step as far as
  the known tokens reach, the chain's rows on scratch slots) equal the layers run from scratch;
- MTP layers built to agree with their target get nearly every draft accepted;
- NEXTN on a MiMo without the flag drafts with its first MTP layer (a one-layer head);
- flags and models: exit 2 (ConfigError in the engine) for a model that is no MiMo, a MiMo with
  fewer than 2 MTP layers, a checkpoint without the MTP weights, NGRAM (TP 2:
  tests/engine/test_speculative_tp.py).
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
from pdcore.testing.tiny_models import make_tiny_mimo, make_tiny_model, mimo_reference

VOCAB = 512


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("mimo")
    no_weights = make_tiny_mimo(str(root / "w"), mtp_layers=2, seed=4)
    with open(os.path.join(no_weights, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    cfg["num_nextn_predict_layers"] = 3  # the checkpoint holds 2
    with open(os.path.join(no_weights, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f)
    return {
        "mimo": make_tiny_mimo(str(root / "m"), mtp_layers=3, seed=1),
        "agree": make_tiny_mimo(str(root / "a"), mtp_layers=3, seed=2, agree=True),
        "one": make_tiny_mimo(str(root / "o"), mtp_layers=1, seed=3),
        "no_weights": no_weights,
        "llama": make_tiny_model(str(root / "l"), seed=5),
    }


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (12, 45, 7, 70)]


def _engine(path: str, algo: str | None, steps: int = 3, multi: bool = True,
            **kw) -> LLMEngine:
    extra = {"speculative_algorithm": algo, "speculative_num_steps": steps,
             "speculative_eagle_topk": 1, "speculative_num_draft_tokens": steps + 1,
             "enable_multi_layer_eagle": multi} if algo else {}
    return LLMEngine(ServerArgs(model_path=path, max_total_tokens=2048,
                                page_size=kw.pop("page_size", 4),
                                chunked_prefill_size=kw.pop("chunk", 16), **extra, **kw))


def _generate(path: str, algo: str | None, prompts, sp: SamplingParams, **kw):
    """Outputs of `prompts` then of the first two again (from the prefix cache), and the
    stats."""
    eng = _engine(path, algo, **kw)
    try:
        outs = eng.generate(prompts, sp, return_logprob=True)
        again = eng.generate(prompts[:2], sp, return_logprob=True)
        assert pages_at_rest(eng.scheduler)
        stats = eng.loop.stats().as_dict()
        if algo:
            drafter = eng.loop.spec.drafter
            assert drafter.failures == 0
            assert drafter.head.name == "MTP"
    finally:
        eng.close()
    return outs + again, stats


@pytest.mark.parametrize("algo,page_size,batch,steps", [
    ("EAGLE", 1, 3, 4), ("NEXTN", 4, 1, 3), ("EAGLE", 4, 3, 2), ("NEXTN", 4, 3, 5)])
def test_greedy_with_mtp_layers_equals_without_and_transformers(models, monkeypatch, algo,
                                                                page_size, batch, steps):
    monkeypatch.setenv("PDSERVE_SPEC_GATE", "0")  # verify every draft
    prompts = _prompts()[:batch]
    sp = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    base, _ = _generate(models["mimo"], None, prompts, sp, page_size=page_size)
    got, st = _generate(models["mimo"], algo, prompts, sp, page_size=page_size, steps=steps)
    assert st["spec_verifies_total"] > 0 and st["spec_draft_tokens_total"] > 0, st
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in base]
    # the reruns from the prefix cache equal the first runs
    assert [o["output_ids"] for o in got[batch:]] == [o["output_ids"] for o in got[:min(2, batch)]]
    for a, b in zip(got, base):
        assert torch.allclose(torch.tensor([e[0] for e in a["output_logprobs"]]),
                              torch.tensor([e[0] for e in b["output_logprobs"]]), atol=1e-3)
    hf = mimo_reference(models["mimo"])
    verdicts = [check_greedy(o["output_ids"], hf_greedy(hf, p, 24),
                             [e[0] for e in o["output_logprobs"]], logprob_tol=1e-3)
                for p, o in zip(prompts, got)]
    assert verdicts.count("identical") >= len(prompts) - 1, verdicts


def test_each_layer_has_its_own_pool(models):
    eng = _engine(models["mimo"], "EAGLE")
    try:
        d = eng.loop.spec.drafter
        assert type(d).__name__ == "MultiLayerDrafter" and d.n == 3 == d.head.num_layers
        ptrs = {t.data_ptr() for k, v in d.pools for t in (k, v)}
        assert len(d.pools) == 3 and len(ptrs) == 6
        assert d.pool_bytes == 3 * 2 * d.k.numel() * d.k.element_size()
    finally:
        eng.close()


def _reference_drafts(target, head, tokens: list[int], c: int, k: int) -> list[int]:
    """k drafts after `tokens` (c = len(tokens) - 1 positions computed), from scratch: the
    target's final-norm hidden states over the sequence, then every chain step runs its layer
    over every position again (fresh pools): layer j at position p reads (layer j-1's output at
    p, token t_{p+1+j}), the drafts standing for the tokens past the sequence; past the last
    layer L, layer L runs one position further each step, fed its own previous output."""
    from pdcore.engine.model.batch import ForwardBatch, SeqSpan

    heads, dim, _ = head.kv_layout

    def run(layer: int, hid: torch.Tensor, ids: list[int]) -> torch.Tensor:
        n = len(ids)
        k_, v_ = torch.zeros(n, 1, heads, dim), torch.zeros(n, 1, heads, dim)
        b = ForwardBatch(torch.tensor(ids), torch.arange(n), torch.arange(n),
                         [SeqSpan(0, n, torch.arange(n))], torch.empty(0, dtype=torch.long))
        return head(b, hid, k_, v_, layer=layer)

    b = ForwardBatch(torch.tensor(tokens[:c]), torch.arange(c), torch.arange(c),
                     [SeqSpan(0, c, torch.arange(c))], torch.empty(0, dtype=torch.long))
    b.capture_hidden = True
    pools = [(torch.zeros(c, 1, heads, dim), torch.zeros(c, 1, heads, dim))
             for _ in target.layers]
    target(b, pools, logits=False)
    ext = list(tokens)
    below = b.hidden
    top = head.num_layers - 1
    out = None
    for j in range(k):
        layer = min(j, top)
        if j <= top:
            hid = below
        else:
            hid = torch.cat([below, out[c - 1 :]])  # out: layer L's previous run
        out = run(layer, hid, ext[1 + layer : c + 1 + j])
        ext.append(int(head.logits(out[-1:]).argmax()))
        if j < top:  # past it, layer L-1's outputs stay layer L's input at positions < c
            below = out
    return ext[len(tokens):]


def test_incremental_drafts_equal_the_layers_run_from_scratch(models, monkeypatch):
    monkeypatch.setenv("PDSERVE_SPEC_GATE", "0")
    eng = _engine(models["mimo"], "EAGLE", steps=5, chunk=16)
    drafter = eng.loop.spec.drafter
    seen: list[tuple[list[int], int, list[int]]] = []
    propose = drafter.propose

    def record(reqs, wants):
        out = propose(reqs, wants)
        seen.extend((r.prompt + r.output, r.num_computed, d) for r, d in zip(reqs, out) if d)
        return out

    drafter.propose = record
    try:
        eng.generate(_prompts(), SamplingParams(max_new_tokens=10, temperature=0.0,
                                                ignore_eos=True))
        target = eng.loop.runner.model
        assert len(seen) > 10 and any(len(d) == 5 for _, _, d in seen)
        for tokens, c, drafts in seen[::3]:
            assert len(tokens) == c + 1
            assert drafts == _reference_drafts(target, drafter.head, tokens, c, len(drafts))
    finally:
        eng.close()


@pytest.mark.parametrize("algo,steps", [("EAGLE", 4), ("NEXTN", 2)])
def test_mtp_layers_that_agree_with_their_target_get_their_drafts_accepted(models, monkeypatch,
                                                                          algo, steps):
    monkeypatch.setenv("PDSERVE_SPEC_GATE", "0")
    prompts = _prompts()
    sp = SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True)
    base, _ = _generate(models["agree"], None, prompts, sp)
    got, st = _generate(models["agree"], algo, prompts, sp, steps=steps)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in base]
    assert st["spec_accept_rate"] > 0.9, st
    assert st["spec_accept_length"] > steps, st  # the drafts + the target's own token
    assert st["spec_accepted_tokens_total"] > 0.9 * st["spec_draft_tokens_total"], st


def test_nextn_on_a_mimo_without_the_flag_drafts_with_its_first_mtp_layer(models,
                                                                         monkeypatch):
    monkeypatch.setenv("PDSERVE_SPEC_GATE", "0")
    prompts = _prompts()[:3]
    sp = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    base, _ = _generate(models["one"], None, prompts, sp)
    eng = _engine(models["one"], "NEXTN", multi=False)
    try:
        d = eng.loop.spec.drafter
        assert type(d).__name__ == "HeadDrafter" and d.head.num_layers == 1
        outs = eng.generate(prompts, sp)
        assert eng.loop.stats()["spec_verifies_total"] > 0
        assert pages_at_rest(eng.scheduler)
    finally:
        eng.close()
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in base[:3]]


def test_sampled_requests_with_mtp_layers(models, monkeypatch):
    monkeypatch.setenv("PDSERVE_SPEC_GATE", "0")
    eng = _engine(models["mimo"], "EAGLE")
    try:
        outs = eng.generate(_prompts(), SamplingParams(max_new_tokens=12, temperature=0.8,
                                                       top_p=0.9, seed=4, ignore_eos=True))
        assert all(len(o["output_ids"]) == 12 for o in outs)
        assert eng.loop.stats()["spec_verifies_total"] > 0
        assert pages_at_rest(eng.scheduler)
    finally:
        eng.close()


def test_flags():
    for algo in ("EAGLE", "NEXTN"):  # no draft path needed: the model's own MTP layers
        ok = ServerArgs(speculative_algorithm=algo, enable_multi_layer_eagle=True)
        ok.validate()
        assert (ok.speculative_num_steps, ok.speculative_num_draft_tokens) == (3, 4)
    for mode in ("prefill", "decode"):  # PD: each layer's K/V travel as one more KV layer
        ServerArgs(speculative_algorithm="EAGLE", enable_multi_layer_eagle=True,
                   disaggregation_mode=mode).validate()
    with pytest.raises(ConfigError, match="NGRAM runs no draft model"):
        ServerArgs(speculative_algorithm="NGRAM", enable_multi_layer_eagle=True).validate()
    ServerArgs(speculative_algorithm="EAGLE", enable_multi_layer_eagle=True,
               tp_size=2).validate()  # tests/engine/test_speculative_tp.py


@pytest.mark.parametrize("model,algo,says", [
    ("llama", "EAGLE", "the model is LlamaForCausalLM"),
    ("one", "NEXTN", "has 1 MTP layer"),
    ("no_weights", "EAGLE", "holds no weights of MTP layer 2")])
def test_models_without_enough_mtp_layers_are_refused(models, capsys, model, algo, says):
    """At the command line (exit 2, before the model loads) and in the engine (ConfigError)."""
    from pdcore.server.startup.args_parser import parse_server_args

    with pytest.raises(SystemExit) as e:
        parse_server_args(["--model-path", models[model], "--speculative-algorithm", algo,
                           "--enable-multi-layer-eagle"])
    assert e.value.code == 2
    assert says in capsys.readouterr().err
    with pytest.raises(ConfigError, match=says):
        _engine(models[model], algo)


def test_the_seed_lines_flags_parse(models):
    from pdcore.server.startup.args_parser import parse_server_args

    args = parse_server_args([
        "--model-path", models["mimo"], "--speculative-algorithm", "EAGLE",
        "--enable-multi-layer-eagle", "--speculative-num-steps", "3",
        "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"])
    assert (args.speculative_algorithm, args.enable_multi_layer_eagle,
            args.speculative_num_draft_tokens) == ("EAGLE", True, 4)
