"""Acceptance for Kubernetes service discovery with real servers: 2 prefill + 2 decode `pdserve
serve` processes (tiny random model, tcp transfer) announced as pods by the API stand-in
(k8s_standin.py, recorded pod objects; no API server can run on this machine), and the router
started as `python -m pdcore.router --service-discovery` with a kubeconfig pointing at it.

The router serves through all four with greedy output identical to the unified engine; a prefill
pod going not Ready is out of rotation after that one watch event and requests keep succeeding
(that server then gets none); a 410 Gone makes both watchers re-list and no worker leaves."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from k8s_standin import KubeStandIn
from test_discovery import make_pod

from pdcore.config import ServerArgs
from pdcore.messages.io import SamplingParams
from pdcore.engine.model.tokenizer import load_tokenizer
from pdcore.runtime.llm_engine import LLMEngine
from pdcore.testing.processes import PDCluster, ServerProcess
from pdcore.testing.tiny_models import make_tiny_model

pytest.importorskip("kubernetes", reason="pip install 'pdcore[kubernetes]'")

NEW = 8
FLAGS = ("--max-total-tokens", "4096", "--page-size", "4")
PROMPTS = ["The quick brown fox", "Once upon a time", "In the beginning", "Kubernetes pods",
           "Prefill and decode", "A 410 Gone"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from pdcore.engine.model.tokenizer import default_model_file

    return make_tiny_model(str(tmp_path_factory.mktemp("k8s") / "m"),
                           tokenizer_from=default_model_file())


@pytest.fixture(scope="module")
def unified(model_dir) -> Iterator[tuple[Any, Callable[[list[int]], list[int]]]]:
    tok = load_tokenizer(ServerArgs(model_path=model_dir))
    eng = LLMEngine(ServerArgs(model_path=model_dir, max_total_tokens=4096, page_size=4))

    def run(ids: list[int]) -> list[int]:
        sp = SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)
        return eng.generate([ids], sp)[0]["output_ids"]

    yield tok, run
    eng.close()


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory) -> Iterator[tuple[PDCluster, KubeStandIn, ServerProcess]]:
    """2P + 2D servers announced as Ready pods, and a discovering router in front."""
    pd = PDCluster("tcp", prefill=2, decode=2, model_path=model_dir, flags=FLAGS)
    api = KubeStandIn().start()
    router = None
    try:
        for s in pd.prefills + pd.decodes:
            s.wait_healthy(600)
        for i, (s, bport) in enumerate(zip(pd.prefills, pd.bootstrap_ports)):
            pod = make_pod("prefill", i, s.port)
            pod["metadata"]["annotations"]["sglang.ai/bootstrap-port"] = str(bport)
            api.apply(pod)
        for i, s in enumerate(pd.decodes):
            api.apply(make_pod("decode", i, s.port))
        kubeconfig = api.kubeconfig(tmp_path_factory.mktemp("kube") / "config")
        router = ServerProcess(
            "--service-discovery", "--selector", "app.kubernetes.io/name=pdserve",
            "--prefill-selector", "app.kubernetes.io/component=prefill",
            "--decode-selector", "app.kubernetes.io/component=decode",
            "--service-discovery-namespace", "pdserve", "--policy", "round_robin",
            "--health-check-interval-secs", "1",
            command=("-m", "pdcore.router"), env={"KUBECONFIG": str(kubeconfig)})
        router.wait_healthy(120)
        yield pd, api, router
    finally:
        if router is not None:
            router.stop()
        api.stop()
        pd.stop()


def workers(router: ServerProcess) -> dict[str, set[str]]:
    listed = httpx.get(router.url + "/workers", timeout=10).json()["workers"]
    return {t: {w["url"] for w in listed if w["worker_type"] == t and w["available"]}
            for t in ("prefill", "decode")}


def wait_until(check: Callable[[], Any], what: str, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


def generate(router: ServerProcess, ids: list[int]) -> list[int]:
    r = httpx.post(router.url + "/generate", timeout=120, json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": NEW, "temperature": 0,
                                              "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def served(pd: PDCluster, server: ServerProcess) -> int:
    return pd.load(server)["disagg_requests_total"]


def test_discovered_pools_serve_fail_over_and_survive_410(cluster, unified) -> None:
    pd, api, router = cluster
    tok, run = unified
    everyone = {"prefill": {s.url for s in pd.prefills}, "decode": {s.url for s in pd.decodes}}
    wait_until(lambda: workers(router) == everyone, "2P + 2D discovered and healthy")

    # greedy through the discovered pools equals the unified engine; round robin uses all four
    before = {s.url: served(pd, s) for s in pd.prefills + pd.decodes}
    for prompt in PROMPTS[:4]:
        ids = list(tok.encode(prompt))
        assert generate(router, ids) == run(ids), prompt
    assert all(served(pd, s) > before[s.url] for s in pd.prefills + pd.decodes)

    # P0 not Ready: one MODIFIED event takes it out; requests keep succeeding, P0 gets none
    p0 = pd.prefills[0]
    events = api.rv
    api.apply(make_pod("prefill", 0, p0.port, "not_ready"))
    assert api.rv == events + 1  # exactly one watch event
    wait_until(lambda: p0.url not in workers(router)["prefill"], "P0 out of rotation")
    p0_count = served(pd, p0)
    for prompt in PROMPTS:
        ids = list(tok.encode(prompt))
        assert generate(router, ids) == run(ids), prompt
    assert served(pd, p0) == p0_count

    # 410 Gone: both watchers re-list and every worker stays registered throughout
    left_lines = router.log().count(" left ")
    lists = api.count("list")
    kept = workers(router)
    api.compact()
    wait_until(lambda: api.count("list") >= lists + 2, "a re-list per role")
    snap = wait_until(lambda: (s := httpx.get(router.url + "/service_discovery",
                                              timeout=10).json())["prefill"]["gone"]
                      and s["decode"]["gone"] and s, "the 410s")
    assert snap["prefill"]["workers"] == sorted(kept["prefill"])
    assert workers(router) == kept
    assert router.log().count(" left ") == left_lines
    ids = list(tok.encode(PROMPTS[0]))
    assert generate(router, ids) == run(ids)

    # the watch goes on after the re-list: P0 Ready again rejoins
    api.apply(make_pod("prefill", 0, p0.port))
    wait_until(lambda: workers(router) == everyone, "P0 back in rotation")
    for s in pd.prefills + pd.decodes:
        assert s.alive(), s.log()[-3000:]
    pd.wait_pages_free()
