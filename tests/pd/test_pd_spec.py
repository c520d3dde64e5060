"""Speculative decoding (NGRAM) through PD (#33 item 3): the decode server speculates from the
first token P sent; greedy output equals a unified server's without speculation, token for
token, over tcp behind our router (P without the flags: a mixed fleet, which NGRAM needs
nothing from P for) and over shm behind sglang-router (both with the flags). Speculated and
grammar-constrained requests share D's batches, the latter drafting what their grammar forces
(jump-forward); D reports `spec_verify_ct` in meta_info and `sglang:spec_accept_length` in
/metrics.

The model is a tiny random Llama with SmolLM2's tokenizer; the prompts repeat stretches of
text, so drafts exist from the first decode step. PDSERVE_SPEC_GATE=0 verifies every draft
(the cost gate would otherwise decide on this machine's timing)."""

from __future__ import annotations

import json
import re
import threading
from typing import Any

import httpx
import pytest

from pdcore.engine.model.tokenizer import default_model_file
from pdcore.testing.processes import PDCluster, ServerProcess
from pdcore.testing.tiny_models import make_tiny_model

SPEC = ("--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "6")
FLAGS = ("--max-total-tokens", "4096", "--page-size", "4",
         "--constrained-json-disable-any-whitespace")  # a random model loops on free whitespace
ENV = {"PDSERVE_SPEC_GATE": "0"}
TEXTS = ["one two three four five " * 6, "the cat sat on the mat, " * 5 + "and the",
         "alpha beta gamma delta " * 4 + "alpha", "def f(x):\n    return x + 1\n" * 3]
REGEX = r"(red|green|blue)-[0-9]{2,4}"


def _body(text: str, new: int = 32, **extra: Any) -> dict[str, Any]:
    return {"text": text, "sampling_params": {"max_new_tokens": new, "temperature": 0,
                                              "ignore_eos": True, **extra}}


@pytest.fixture(scope="module")
def servers(tmp_path_factory) -> Any:
    model = make_tiny_model(str(tmp_path_factory.mktemp("spec") / "m"), seed=13,
                            tokenizer_from=default_model_file())
    # the reference decodes one token at a time: no speculation, no jump-forward
    plain = ServerProcess("--model-path", model, *FLAGS, env={"PDSERVE_JUMP_FORWARD": "0"})
    tcp = PDCluster("tcp", model_path=model, flags=FLAGS, decode_flags=SPEC, env=ENV)
    shm = PDCluster("shm", model_path=model, flags=(*FLAGS, *SPEC), router="sglang", env=ENV)
    try:
        plain.wait_healthy(180)
        tcp.start()
        shm.start()
        yield {"plain": plain, "pd-tcp": tcp, "pd-shm-sglang-router": shm}
    finally:
        shm.stop()
        tcp.stop()
        plain.stop()


def _generate(url: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_pd_speculative_greedy_equals_unified_without(servers) -> None:
    ref = [_generate(servers["plain"].url, _body(t))["output_ids"] for t in TEXTS]
    for name in ("pd-tcp", "pd-shm-sglang-router"):
        c: PDCluster = servers[name]
        # each text twice: the second time D drafts from the first answer (its cross-request
        # n-gram cache) as well as from the prompt
        outs = [_generate(c.url, _body(t)) for t in TEXTS for _ in range(2)]
        assert [o["output_ids"] for o in outs] == [r for r in ref for _ in range(2)], name
        assert sum(o["meta_info"]["spec_verify_ct"] for o in outs) > 0, name
        stats = c.load(c.decodes[0])
        assert stats["spec_accepted_tokens_total"] > 0, (name, stats)
        c.wait_pages_free(30)
        metrics = httpx.get(c.decodes[0].url + "/metrics", timeout=30).text
        m = re.search(r'^sglang:spec_accept_length\{[^}]*\} ([0-9.e+-]+)$', metrics,
                      re.MULTILINE)
        assert m and float(m.group(1)) > 1.0, (name, m)


def test_grammar_requests_beside_speculated_ones(servers) -> None:
    """Constrained requests decode in the same batches as speculating ones, their drafts
    (jump-forward tokens the grammar forces, n-gram drafts) verified under the grammar's masks:
    the output matches the grammar and equals the reference's, which decodes one token at a
    time."""
    schema = {"type": "object", "properties": {
        "customer_identifier": {"type": "integer", "minimum": 0, "maximum": 9999},
        "shipping_priority": {"enum": ["low", "high"]}, "is_gift_wrapped": {"type": "boolean"}},
        "required": [
        "customer_identifier", "shipping_priority", "is_gift_wrapped"],
        "additionalProperties": False}
    constrained = [
        {"text": "Pick a colour.", "sampling_params": {"max_new_tokens": 24, "temperature": 0,
                                                     "regex": REGEX}},
        {"text": "An order as JSON.", "sampling_params": {
            "max_new_tokens": 96, "temperature": 0, "json_schema": json.dumps(schema)}}]
    want = [_generate(servers["plain"].url, b) for b in constrained]
    assert re.fullmatch(REGEX, want[0]["text"]), want[0]["text"]
    assert set(json.loads(want[1]["text"])) == set(schema["properties"]), want[1]["text"]
    for name in ("pd-tcp", "pd-shm-sglang-router"):
        c: PDCluster = servers[name]
        results: dict[int, dict[str, Any]] = {}

        def run(i: int, body: dict[str, Any], url: str = c.url,
                into: dict[int, dict[str, Any]] = results) -> None:
            into[i] = _generate(url, body)

        bodies = [_body(t, 48) for t in TEXTS] + constrained
        threads = [threading.Thread(target=run, args=(i, b)) for i, b in enumerate(bodies)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        assert len(results) == len(bodies), name
        for k, ref in enumerate(want):
            got = results[len(TEXTS) + k]
            assert got["output_ids"] == ref["output_ids"], (name, got["text"], ref["text"])
        assert c.load(c.decodes[0])["spec_jump_forward_tokens_total"] > 0, name
        c.wait_pages_free(30)


def test_stop_strings_and_logprobs_with_speculation(servers) -> None:
    """A stop string inside a verify's accepted tokens ends the text where the plain server's
    does; logprobs come one per token, as without speculation."""
    plain = _generate(servers["plain"].url, _body(TEXTS[0], 40))
    stop = plain["text"][len(plain["text"]) // 2:][:4]
    assert stop.strip(), plain["text"]
    want = _generate(servers["plain"].url, _body(TEXTS[0], 40, stop=[stop]))
    extra = {"return_logprob": True}
    want_lp = _generate(servers["plain"].url, {**_body(TEXTS[1], 24), **extra})
    for name in ("pd-tcp", "pd-shm-sglang-router"):
        c: PDCluster = servers[name]
        got = _generate(c.url, _body(TEXTS[0], 40, stop=[stop]))
        assert got["text"] == want["text"], (name, got["text"], want["text"])
        assert got["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"]
        lp = _generate(c.url, {**_body(TEXTS[1], 24), **extra})
        toks = [e[1] for e in lp["meta_info"]["output_token_logprobs"]]
        assert toks == lp["output_ids"] == want_lp["output_ids"], name
        ref = [e[0] for e in want_lp["meta_info"]["output_token_logprobs"]]
        got_lp = [e[0] for e in lp["meta_info"]["output_token_logprobs"]]
        assert max(abs(a - b) for a, b in zip(got_lp, ref)) < 1e-3, name
        c.wait_pages_free(30)
