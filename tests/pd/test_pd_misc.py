"""PD paths beyond the data: the `fake` backend end to end, profiling P and D separately, and
2P2D token identity (on a tiny random model: SmolLM2 through PD is test_pd_smollm2's, and four
SmolLM2 servers cost this check some 25 s more of CI)."""

from __future__ import annotations

import os

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


def test_2p2d_token_identical(tiny_dir):
    from pdcore.config import ServerArgs
    from pdcore.engine.model.tokenizer import load_tokenizer
    from pdcore.messages.io import SamplingParams
    from pdcore.runtime.llm_engine import LLMEngine
    from pdcore.testing.prompts import prompt_token_ids

    flags = ("--max-total-tokens", "16384", "--page-size", "16", "--chunked-prefill-size", "256")
    prompts = prompt_token_ids(load_tokenizer(ServerArgs(model_path=tiny_dir)))
    eng = LLMEngine(ServerArgs(model_path=tiny_dir, max_total_tokens=16384, page_size=16))
    try:
        unified = eng.generate(prompts, SamplingParams(max_new_tokens=48, temperature=0.0))
    finally:
        eng.close()
    c = PDCluster("tcp", prefill=2, decode=2, model_path=tiny_dir, flags=flags)
    c.start()
    try:
        assert_same_tokens(generate_all(c.url, prompts), unified)
        assert_same_tokens(generate_all(c.url, prompts, stream=True), unified)
        for s in c.prefills + c.decodes:  # round robin reached every server
            assert c.load(s)["generation_tokens_total"] > 0
        c.wait_pages_free()
    finally:
        c.stop()
