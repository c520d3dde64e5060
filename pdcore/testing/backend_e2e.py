"""End-to-end suite every transfer-backend plugin runs against itself in a few lines:

    from pdcore.testing.backend_e2e import BackendE2E

    class TestMyBackendE2E(BackendE2E):
        backend = "mybackend"
        env = {"MY_SDK_LOG": "warn"}     # extra environment for every server

It starts real P + D + router processes on loopback: SmolLM2 greedy output through PD must be
token-identical to the unified engine; the fault scenarios of pdcore.testing.pd_faults (kill P
in flight, kill D mid-transfer, client disconnect) run on a tiny model, one after another on
one cluster.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar

import httpx
import pytest

from pdcore.testing import pd_faults
from pdcore.testing.processes import PDCluster

NEW_TOKENS = 48
SMOLLM2_FLAGS = ("--max-total-tokens", "16384", "--page-size", "16",
                 "--chunked-prefill-size", "256")


def unified_reference() -> tuple[list[list[int]], list[list[int]]]:
    from pdcore.config import ServerArgs
    from pdcore.messages.io import SamplingParams
    from pdcore.engine.model.tokenizer import load_tokenizer
    from pdcore.runtime.llm_engine import LLMEngine
    from pdcore.testing.prompts import prompt_token_ids

    prompts = prompt_token_ids(load_tokenizer(ServerArgs()))
    engine = LLMEngine(ServerArgs(max_total_tokens=16384, page_size=16))
    try:
        outs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0))
    finally:
        engine.close()
    return prompts, [o["output_ids"] for o in outs]


def pd_outputs(url: str, prompts: list[list[int]], stream: bool = False) -> list[list[int]]:
    def one(ids: list[int]) -> list[int]:
        body: dict[str, Any] = {"input_ids": ids, "stream": stream, "sampling_params": {
            "temperature": 0.0, "max_new_tokens": NEW_TOKENS}}
        if not stream:
            r = httpx.post(url + "/generate", json=body, timeout=600)
            assert r.status_code == 200, r.text
            return r.json()["output_ids"]
        import json

        last: dict[str, Any] = {}
        with httpx.stream("POST", url + "/generate", json=body, timeout=600) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    last = json.loads(line[6:])
                    assert "error" not in last, last
        return last["output_ids"]

    with ThreadPoolExecutor(len(prompts)) as ex:
        return list(ex.map(one, prompts))


class BackendE2E:
    backend: ClassVar[str] = ""
    env: ClassVar[dict[str, str]] = {}

    @pytest.fixture(scope="class")
    def tiny_model(self, tmp_path_factory: pytest.TempPathFactory) -> str:
        from pdcore.engine.model.tokenizer import default_model_file
        from pdcore.testing.tiny_models import make_tiny_model

        return make_tiny_model(str(tmp_path_factory.mktemp("e2e") / "m"),
                               tokenizer_from=default_model_file(), max_positions=8192)

    @pytest.fixture(scope="class")
    def fault_cluster(self, tiny_model: str):
        """One cluster for the three fault scenarios, one after another (each restarts what it
        killed on the same ports and leaves every page free): two cluster starts fewer."""
        c = pd_faults.fault_cluster(self.backend, tiny_model, self.env)
        yield c
        c.stop()

    def test_smollm2_token_identical_to_unified(self) -> None:
        prompts, want = unified_reference()
        c = PDCluster(self.backend, flags=SMOLLM2_FLAGS, env=self.env).start()
        try:
            assert pd_outputs(c.url, prompts) == want
            assert pd_outputs(c.url, prompts, stream=True) == want
            c.wait_pages_free()
        finally:
            c.stop()

    def test_kill_prefill_in_flight(self, fault_cluster: PDCluster) -> None:
        pd_faults.kill_prefill_in_flight(fault_cluster)

    def test_kill_decode_mid_transfer(self, fault_cluster: PDCluster) -> None:
        pd_faults.kill_decode_mid_transfer(fault_cluster)

    def test_client_disconnect_mid_stream(self, fault_cluster: PDCluster) -> None:
        pd_faults.client_disconnect_mid_stream(fault_cluster)
