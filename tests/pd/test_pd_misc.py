"""PD paths beyond the data: the `fake` backend end to end, profiling P and D separately, and
2P2D token identity (on a tiny random model: SmolLM2 through PD is test_pd_smollm2's, and four
SmolLM2 servers cost this check some 25 s more of CI)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest
from helpers import assert_same_tokens, generate_all

from pdcore.testing.processes import PDCluster
from pdcore.testing.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from pdcore.engine.model.tokenizer import default_model_file

    return make_tiny_model(str(tmp_path_factory.mktemp("pdmisc") / "m"),
                           tokenizer_from=default_model_file(), max_positions=8192)


def test_fake_backend_runs_the_whole_path(tiny_dir):
    c = PDCluster("fake", model_path=tiny_dir, flags=("--max-total-tokens", "4096")).start()
    try:
        for stream in (False, True):
            body = {"text": "hello world", "stream": stream,
                    "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}
            r = httpx.post(c.url + "/generate", json=body, timeout=120)
            assert r.status_code == 200, r.text
            if not stream:
                assert r.json()["meta_info"]["completion_tokens"] == 6
        c.wait_pages_free()
        # the protocol ran for both requests (chunks planned and completed) although the
        # fake backend moved no byte
        p_load, d_load = c.load(c.prefills[0]), c.load(c.decodes[0])
        assert p_load["kv_chunks"] >= 2 and p_load["kv_transfers"] >= 2, p_load
        assert d_load["kv_transfers"] >= 2, d_load
    finally:
        c.stop()


def test_profile_prefill_and_decode_separately(tiny_dir, tmp_path):
    c = PDCluster("tcp", model_path=tiny_dir, flags=("--max-total-tokens", "4096")).start()
    try:
        dirs = {}
        for name, server in (("prefill", c.prefills[0]), ("decode", c.decodes[0])):
            dirs[name] = str(tmp_path / name)
            r = httpx.post(server.url + "/start_profile", json={"output_dir": dirs[name]},
                           timeout=60, headers=server.admin_headers)
            assert r.status_code == 200, r.text
            again = httpx.post(server.url + "/start_profile", json={}, timeout=60,
                               headers=server.admin_headers)
            assert again.status_code >= 400  # already profiling: a clear error, no crash
        body = {"text": "profile me", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
        assert httpx.post(c.url + "/generate", json=body, timeout=120).status_code == 200
        for name, server in (("prefill", c.prefills[0]), ("decode", c.decodes[0])):
            r = httpx.post(server.url + "/stop_profile", timeout=120,
                           headers=server.admin_headers)
            assert r.status_code == 200, r.text
            assert os.listdir(dirs[name]), f"no trace written for {name}"
    finally:
        c.stop()


FLAGS_2P2D = ("--max-total-tokens", "16384", "--page-size", "16", "--chunked-prefill-size", "256")
# request migration (router/migrate.py): a silent stream's decode server is probed after 1 s
MIGRATION_FLAGS = ("--migration-stall-secs", "1", "--health-check-timeout-secs", "3")


@pytest.fixture(scope="module")
def pd2x2(tiny_dir):
    """One 2P2D tcp cluster for the identity check, then the migration tests (the last one
    kills a decode server)."""
    c = PDCluster("tcp", prefill=2, decode=2, model_path=tiny_dir, flags=FLAGS_2P2D,
                  router_flags=MIGRATION_FLAGS)
    c.start()
    try:
        yield c
    finally:
        c.stop()


def test_2p2d_token_identical(tiny_dir, pd2x2):
    from pdcore.config import ServerArgs
    from pdcore.engine.model.tokenizer import load_tokenizer
    from pdcore.messages.io import SamplingParams
    from pdcore.runtime.llm_engine import LLMEngine
    from pdcore.testing.prompts import prompt_token_ids

    prompts = prompt_token_ids(load_tokenizer(ServerArgs(model_path=tiny_dir)))
    eng = LLMEngine(ServerArgs(model_path=tiny_dir, max_total_tokens=16384, page_size=16))
    try:
        unified = eng.generate(prompts, SamplingParams(max_new_tokens=48, temperature=0.0))
    finally:
        eng.close()
    c = pd2x2
    assert_same_tokens(generate_all(c.url, prompts), unified)
    assert_same_tokens(generate_all(c.url, prompts, stream=True), unified)
    for s in c.prefills + c.decodes:  # round robin reached every server
        assert c.load(s)["generation_tokens_total"] > 0
    c.wait_pages_free()


def _stream(url: str, path: str, body: dict, at_event: int = 0, fault=None
            ) -> tuple[bytes, list]:
    """A stream's raw bytes and its data events (JSON, or b"[DONE]"); `fault()` runs once
    the `at_event`-th event came."""
    raw, events, buf = b"", [], b""
    with httpx.stream("POST", url + path, json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for chunk in r.iter_bytes():
            raw, buf = raw + chunk, buf + chunk
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                for line in event.split(b"\n"):
                    if line.startswith(b"data:"):
                        data = line[5:].strip()
                        events.append(data if data == b"[DONE]" else json.loads(data))
                        if fault is not None and len(events) == at_event:
                            fault()
    return raw, events


def _freeze_serving_decode(c: PDCluster):
    """SIGSTOP the decode server the router streams from (its one request in flight), mid-stream
    for sure: every decode server is frozen first (the tiny model is fast), then the others
    are thawed once the router's /workers told which one it is."""
    alive = [d for d in c.decodes if d.alive()]
    for d in alive:
        os.killpg(d.proc.pid, signal.SIGSTOP)
    workers = httpx.get(c.url + "/workers", timeout=5).json()["workers"]
    busy = [w["url"] for w in workers if w["worker_type"] == "decode" and w["in_flight"]]
    for d in alive:
        if d.url not in busy[:1]:
            os.killpg(d.proc.pid, signal.SIGCONT)
    assert len(busy) == 1, workers
    return next(d for d in c.decodes if d.url == busy[0])


def _migrations(c: PDCluster, reason: str) -> float:
    text = httpx.get(c.url + "/metrics", timeout=10).text
    key = f'pdrouter_migrations_total{{outcome="resumed",reason="{reason}"}} '
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(key))


def _check_clean_stream(raw: bytes, events: list) -> None:
    assert b"pd-ids" not in raw and b"error" not in raw, raw[-2000:]
    assert events[-1] == b"[DONE]" and events.count(b"[DONE]") == 1


def test_migration_sigstop_decode_mid_stream_chat(pd2x2):
    """A decode server frozen mid-stream (SIGSTOP): after --migration-stall-secs and a /health
    probe with no answer the router resumes the chat stream on the other pair. The stream has
    two greedy choices with logprobs: each choice moves on its own and the client gets the
    undisturbed run's text and tokens per choice, one role chunk and one finish each, one
    usage chunk for both, nothing repeated or missing. A /v1/responses stream on the same
    server moves too."""
    c = pd2x2
    body = {"messages": [{"role": "user", "content": "migrate me " * 20}], "stream": True,
            "max_tokens": 200, "temperature": 0, "n": 2, "ignore_eos": True,
            "logprobs": True, "top_logprobs": 2, "stream_options": {"include_usage": True}}
    _, ref = _stream(c.url, "/v1/chat/completions", body)
    # a /v1/responses stream on the same decode server moves with it (round robin: it goes
    # first, a short request to the other server, then the chat stream)
    resp_body = {"input": "a response that moves " * 10, "stream": True, "temperature": 0,
                 "max_output_tokens": 600, "ignore_eos": True}
    _, resp_ref = _stream(c.url, "/v1/responses", resp_body)
    frozen, resp_out, streaming = [], [], threading.Event()

    def freeze() -> None:
        frozen.append(_freeze_serving_decode(c))

    t = threading.Thread(target=lambda: resp_out.append(_stream(
        c.url, "/v1/responses", resp_body, at_event=3, fault=streaming.set)))
    t.start()
    assert streaming.wait(60), "the responses stream did not start"
    assert httpx.post(c.url + "/generate", json={"input_ids": [5, 6], "sampling_params": {
        "max_new_tokens": 1}}, timeout=60).status_code == 200  # to the other decode server
    before = _migrations(c, "stalled")
    try:
        raw, got = _stream(c.url, "/v1/chat/completions", body, at_event=3, fault=freeze)
        t.join(120)
    finally:
        for d in frozen:
            os.killpg(d.proc.pid, signal.SIGCONT)
    assert frozen, "the stream ended before the fault"
    _check_clean_stream(raw, got)
    _check_moved_responses(resp_out, resp_ref)

    def choices(events: list, i: int) -> list:
        return [ch for e in events[:-1] for ch in e["choices"] if ch["index"] == i]

    for i in (0, 1):
        mine, theirs = choices(got, i), choices(ref, i)
        assert "".join(ch["delta"].get("content") or "" for ch in mine) == "".join(
            ch["delta"].get("content") or "" for ch in theirs), i
        # logprobs: each chunk carries its own tokens' (a resumed leg's from its first token)
        lps = [[lp for ch in chs for lp in (ch["logprobs"] or {}).get("content") or []]
               for chs in (mine, theirs)]
        assert [lp["token"] for lp in lps[0]] == [lp["token"] for lp in lps[1]]
        assert len(lps[0]) == 200 and all(len(lp["top_logprobs"]) == 2 for lp in lps[0])
        assert all(abs(x["logprob"] - y["logprob"]) < 1e-2 for x, y in zip(*lps, strict=True))
        assert sum("role" in ch["delta"] for ch in mine) == 1
        assert [ch["finish_reason"] for ch in mine if ch["finish_reason"]] == ["length"]
    usage = ("prompt_tokens", "completion_tokens", "total_tokens")  # cached_tokens differ
    assert sum(bool(e.get("usage")) for e in got[:-1]) == 1 and got[-2]["usage"]
    assert [got[-2]["usage"][k] for k in usage] == [ref[-2]["usage"][k] for k in usage]
    assert got[-2]["usage"]["completion_tokens"] == 400
    assert _migrations(c, "stalled") >= before + 3  # the responses stream, each choice
    c.wait_pages_free(60)  # the thawed server saw its client go and freed the request


def _check_moved_responses(out: list, ref: list) -> None:
    """A moved /v1/responses stream reads as one: sequence numbers 0, 1, ... with no gap, one
    response id and created_at, item ids kept, the undisturbed text in the deltas and in the
    final response object, which is the undisturbed one but for the ids."""
    assert out, "the responses stream did not end"
    raw, got = out[0]
    assert b"pd-ids" not in raw and b"event: error" not in raw and b"[DONE]" not in raw, \
        raw[-2000:]
    assert [e["sequence_number"] for e in got] == list(range(len(got)))
    kinds = [e["type"] for e in got]
    assert kinds.count("response.created") == 1 and kinds[-1] == "response.incomplete", kinds
    assert kinds.count("response.output_item.added") == 1, kinds  # the message, once

    def text(events: list) -> str:
        return "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")

    assert text(got) == text(ref) and text(ref)
    first, last = got[0]["response"], got[-1]["response"]
    assert (last["id"], last["created_at"]) == (first["id"], first["created_at"])
    item_ids = {e["item_id"] for e in got if "item_id" in e}
    assert item_ids == {last["output"][0]["id"]}, item_ids
    assert last["output"][0]["content"][0]["text"] == text(ref)
    assert last["usage"]["output_tokens"] == ref[-1]["response"]["usage"]["output_tokens"]


def test_frozen_decode_before_the_answer_is_retried_whole(pd2x2):
    """A request not streamed has sent its client nothing: when its decode server freezes
    (SIGSTOP) before answering, the router sees /health unanswered after
    --migration-stall-secs and runs the whole request on the other pair."""
    c = pd2x2
    _wait_rotation(c)
    body = {"input_ids": list(range(9, 50)),
            "sampling_params": {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}}
    ref = httpx.post(c.url + "/generate", json=body, timeout=120).json()
    out: list = []
    t = threading.Thread(target=lambda: out.append(
        httpx.post(c.url + "/generate", json=body, timeout=120)))
    t.start()
    frozen = None
    try:
        deadline = time.monotonic() + 30
        while frozen is None and time.monotonic() < deadline:
            workers = httpx.get(c.url + "/workers", timeout=5).json()["workers"]
            if any(w["worker_type"] == "decode" and w["in_flight"] for w in workers):
                frozen = _freeze_serving_decode(c)
        t.join(150)  # the request's own bound is 120 s (stall, probe and rerun took > 60 s once)
    finally:
        if frozen is not None:
            os.killpg(frozen.proc.pid, signal.SIGCONT)
    assert frozen is not None and out, "the request was not caught in flight"
    assert out[0].status_code == 200, out[0].text
    assert out[0].json()["output_ids"] == ref["output_ids"]
    c.wait_pages_free(60)


@pytest.mark.parametrize("sampling", [{"temperature": 0},
                                      {"temperature": 0.9, "top_p": 0.95, "seed": 1234}],
                         ids=["greedy", "seeded"])
def test_resume_protocol_continues_the_output(pd2x2, sampling):
    """What a resumed leg gets (pd_resume_ids, sent here directly): P prefills prompt + the ids,
    D decodes on, and the answer is the undisturbed one whole: ids, text, counts; a seeded
    sampled request draws what it would have (the generators skip the draws already made)."""
    c = pd2x2
    body = {"input_ids": list(range(7, 40)),
            "sampling_params": {"max_new_tokens": 24, "ignore_eos": True, **sampling}}
    ref = httpx.post(c.url + "/generate", json=body, timeout=120).json()
    for k in (1, 9):
        r = httpx.post(c.url + "/generate", json={**body, "pd_resume_ids": ref["output_ids"][:k]},
                       timeout=120)
        assert r.status_code == 200, r.text
        got = r.json()
        assert got["output_ids"] == ref["output_ids"], k
        assert got["text"] == ref["text"]
        assert got["meta_info"]["completion_tokens"] == 24
        assert got["meta_info"]["prompt_tokens"] == 33
    spent = httpx.post(c.url + "/generate", json={**body, "pd_resume_ids": ref["output_ids"]},
                       timeout=60)
    assert spent.status_code == 400 and "max_new_tokens" in spent.text, spent.text
    c.wait_pages_free(30)


def test_migration_kill_decode_mid_stream_generate(pd2x2):
    """kill -9 of the decode server mid-stream: the connection breaks, the router resumes the
    /generate stream (prompt + streamed ids through a prefill) on the survivor; cumulative ids
    run on with none repeated or missing and end as the undisturbed run's; a request not
    streamed that was decoding on the same server is run again whole on the survivor (its
    client had nothing yet) and gets the whole answer; no page leaked on the survivors.
    (Runs last: the killed server stays down.)"""
    c = pd2x2
    _wait_rotation(c)
    body = {"input_ids": list(range(5, 60)), "stream": True, "return_logprob": True,
            "top_logprobs_num": 2,
            "sampling_params": {"max_new_tokens": 160, "temperature": 0, "ignore_eos": True}}
    _, ref = _stream(c.url, "/generate", body)
    before = _migrations(c, "broken") + _migrations(c, "stalled")
    # a request not streamed on the same decode server (round robin: it goes first, a short
    # one to the other server, then the stream): its whole answer comes from the survivor
    whole = {"input_ids": list(range(3, 40)),
             "sampling_params": {"max_new_tokens": 700, "temperature": 0, "ignore_eos": True}}
    whole_ref = httpx.post(c.url + "/generate", json=whole, timeout=120).json()
    assert httpx.post(c.url + "/generate", json=body | {"stream": False},
                      timeout=120).status_code == 200  # round robin: whole goes where this did not
    out: list = []
    t = threading.Thread(target=lambda: out.append(
        httpx.post(c.url + "/generate", json=whole, timeout=120)))
    t.start()
    deadline = time.monotonic() + 30
    while not any(w["worker_type"] == "decode" and w["in_flight"]
                  for w in httpx.get(c.url + "/workers", timeout=5).json()["workers"]):
        assert time.monotonic() < deadline and not out, "the whole request was not caught"
        time.sleep(0.02)
    spacer = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 1}}
    assert httpx.post(c.url + "/generate", json=spacer, timeout=60).status_code == 200

    raw, got = _stream(c.url, "/generate", body, at_event=1,
                       fault=lambda: _freeze_serving_decode(c).kill())
    t.join(120)
    assert out and out[0].status_code == 200, out and out[0].text
    assert out[0].json()["output_ids"] == whole_ref["output_ids"]
    assert out[0].json()["meta_info"]["completion_tokens"] == 700
    _check_clean_stream(raw, got)
    counts = [len(e["output_ids"]) for e in got[:-1]]
    assert counts == sorted(set(counts)), counts  # each event adds tokens, none repeated
    assert got[-2]["output_ids"] == ref[-2]["output_ids"]
    assert got[-2]["text"] == ref[-2]["text"]
    assert got[-2]["meta_info"]["completion_tokens"] == 160
    assert got[-2]["meta_info"]["prompt_tokens"] == 55
    # logprobs run from the first output token in every event, the resumed leg's too: the
    # prompt's (P's, of the first leg) and the output's, each token with its 2 top entries
    meta, ref_meta = got[-2]["meta_info"], ref[-2]["meta_info"]
    assert [e[1] for e in meta["output_token_logprobs"]] == got[-2]["output_ids"]
    assert len(meta["output_top_logprobs"]) == 160 and all(
        len(t) == 2 for t in meta["output_top_logprobs"])
    assert all(abs(x[0] - y[0]) < 1e-2 for x, y in zip(
        meta["output_token_logprobs"], ref_meta["output_token_logprobs"], strict=True))
    assert meta["input_token_logprobs"] == ref_meta["input_token_logprobs"]
    # broken (the reset), or stalled when the frozen-then-killed server's silence was seen
    # first (a loaded machine)
    assert _migrations(c, "broken") + _migrations(c, "stalled") == before + 1
    assert sum(d.alive() for d in c.decodes) == 1
    c.wait_pages_free(30)
    # the last decode server killed too: no pair can take the stream, which ends as it did
    # before migration (one error event, then [DONE]), naming why the resume failed
    raw, got = _stream(c.url, "/generate", body, at_event=1,
                       fault=lambda: _freeze_serving_decode(c).kill())
    errors = [e for e in got[:-1] if "error" in e]
    assert got[-1] == b"[DONE]" and len(errors) == 1 and b"pd-ids" not in raw, raw[-800:]
    assert errors[0]["error"]["code"] == "decode_stream_error"
    assert "no server could take it over" in errors[0]["error"]["message"], errors


def _wait_rotation(c: PDCluster, timeout: float = 30.0) -> None:
    """Until the router has every worker back in rotation (after the SIGSTOP test)."""
    deadline = time.monotonic() + timeout
    while httpx.get(c.url + "/readiness", timeout=5).status_code != 200 or any(
            not w["healthy"] for w in httpx.get(c.url + "/workers", timeout=5).json()["workers"]):
        assert time.monotonic() < deadline, httpx.get(c.url + "/workers", timeout=5).text
        time.sleep(0.2)
