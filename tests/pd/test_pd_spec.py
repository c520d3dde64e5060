"""Speculative decoding (NGRAM) through PD (#33 item 3): the decode server speculates from the
first token P sent; greedy output equals a unified server's without speculation, token for
token, over tcp behind our router (P without the flags: a mixed fleet, which NGRAM needs
nothing from P for) and over shm behind sglang-router (both with the flags). Speculated and
grammar-constrained requests share D's batches; D reports `spec_verify_ct` in meta_info and
`sglang:spec_accept_length` in /metrics.

The model is a tiny random Llama with SmolLM2's tokenizer; the prompts repeat stretches of
text, so drafts exist from the first decode step. PDSERVE_SPEC_GATE=0 verifies every draft
(the cost gate would otherwise decide on this machine's timing)."""

from __future__ import annotations

import re
import threading
from typing import Any

import httpx
import pytest

from pdcore.engine.tokenizer import default_model_file
from pdcore.testing.processes import PDCluster, ServerProcess
from pdcore.testing.tiny_models import make_tiny_model

SPEC = ("--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "6")
FLAGS = ("--max-total-tokens", "4096", "--page-size", "4")
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
    plain = ServerProcess("--model-path", model, *FLAGS)
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
    """A regex-constrained request decodes in the same batches as speculating ones: it is not
    speculated (its matcher advances one token at a time) and still matches."""
    for name in ("pd-tcp", "pd-shm-sglang-router"):
        c: PDCluster = servers[name]
        results: dict[int, dict[str, Any]] = {}

        def run(i: int, body: dict[str, Any], url: str = c.url,
                into: dict[int, dict[str, Any]] = results) -> None:
            into[i] = _generate(url, body)

        bodies = [_body(t, 48) for t in TEXTS] + [
            {"text": "Pick a colour.", "sampling_params": {"max_new_tokens": 24,
                                                         "temperature": 0, "regex": REGEX}}]
        threads = [threading.Thread(target=run, args=(i, b)) for i, b in enumerate(bodies)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        assert len(results) == len(bodies), name
        assert re.fullmatch(REGEX, results[len(TEXTS)]["text"]), results[len(TEXTS)]["text"]
        assert results[len(TEXTS)]["meta_info"]["spec_verify_ct"] == 0
        c.wait_pages_free(30)
