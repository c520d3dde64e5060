"""Kubernetes service discovery against the API stand-in (k8s_standin.py; no API server can run
here): the router's real `kubernetes` client lists and watches recorded pod objects, and the
registry follows them: ADDED Ready joins, ADDED not-Ready waits, MODIFIED to Ready joins,
MODIFIED to not-Ready and a deletion mark leave, DELETED leaves, a 410 Gone re-lists without
touching a worker. Fake workers (tests/router/fake_workers.py) stand behind the pods here; the
model-serving acceptance run is test_discovery_e2e.py."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from fake_workers import ServerThread
from k8s_standin import KubeStandIn, fixture

from pdcore.errors import ConfigError
from pdcore.router.app import create_app
from pdcore.router.cli import parse_router_args
from pdcore.router.config import RouterConfig

pytest.importorskip("kubernetes", reason="pip install 'pdcore[kubernetes]'")

ROLE_LABEL = "app.kubernetes.io/component"
SELECTORS: dict[str, Any] = {"selector": {"app.kubernetes.io/name": "pdserve"},
                             "prefill_selector": {ROLE_LABEL: "prefill"},
                             "decode_selector": {ROLE_LABEL: "decode"}}


def make_pod(role: str, i: int, port: int, state: str = "ready") -> dict[str, Any]:
    """A recorded pod of `role` in `state` (ready | not_ready | terminating), made pod #i whose
    server listens on 127.0.0.1:port."""
    pod = copy.deepcopy(fixture(f"pod_{role}_{state}.json"))
    meta = pod["metadata"]
    meta["name"] = meta["name"][:-5] + f"pod{i:02d}"
    meta["uid"] = meta["uid"][:-2] + f"{i:02d}"
    meta["annotations"]["pdserve.ai/port"] = str(port)
    if role == "prefill":
        meta["annotations"]["sglang.ai/bootstrap-port"] = str(9100 + i)
    return pod


@pytest.fixture
def standin(tmp_path, monkeypatch) -> Iterator[KubeStandIn]:
    api = KubeStandIn().start()
    monkeypatch.setenv("KUBECONFIG", str(api.kubeconfig(tmp_path / "kubeconfig")))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    yield api
    api.stop()


def wait_until(check: Callable[[], Any], what: str, timeout: float = 15.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def available(router: httpx.Client) -> dict[str, set[str]]:
    workers = router.get("/workers").json()["workers"]
    return {t: {w["url"] for w in workers if w["worker_type"] == t and w["available"]}
            for t in ("prefill", "decode")}


def registered(router: httpx.Client) -> dict[str, set[str]]:
    workers = router.get("/workers").json()["workers"]
    return {t: {w["url"] for w in workers if w["worker_type"] == t} for t in ("prefill", "decode")}


def test_registry_follows_pods(standin: KubeStandIn, fake_worker) -> None:
    p0, p1 = fake_worker("prefill"), fake_worker("prefill")
    d0, d1 = fake_worker("decode"), fake_worker("decode")
    standin.apply(make_pod("prefill", 0, p0.server.port))
    standin.apply(make_pod("decode", 0, d0.server.port))
    config = RouterConfig(pd_disaggregation=True, service_discovery=True,
                          service_discovery_namespace="pdserve", policy="round_robin",
                          health_check_interval_secs=1, request_timeout_secs=20, **SELECTORS)
    app = create_app(config)
    server = ServerThread(app).start()
    client = httpx.Client(base_url=server.url, timeout=20)
    registry = app.state.router.registry
    try:
        # the initial list: both pods join once their /health passes
        wait_until(lambda: available(client) == {"prefill": {p0.url}, "decode": {d0.url}},
                   "the listed pods to join")
        assert registry.get(p0.url).bootstrap_port == 9100
        assert registry.get(d0.url).bootstrap_port is None
        # ADDED not Ready: known, not a worker; MODIFIED to Ready: joins
        standin.apply(make_pod("prefill", 1, p1.server.port, "not_ready"))
        wait_until(lambda: len(client.get("/service_discovery").json()["prefill"]["pods"]) == 2,
                   "the not-Ready pod to be seen")
        assert p1.url not in registered(client)["prefill"]
        standin.apply(make_pod("prefill", 1, p1.server.port))
        standin.apply(make_pod("decode", 1, d1.server.port))
        wait_until(lambda: available(client) == {"prefill": {p0.url, p1.url},
                                                 "decode": {d0.url, d1.url}}, "2P + 2D")
        for i in range(4):
            r = client.post("/generate", json={"text": f"hi {i}", "sampling_params": {}})
            assert r.status_code == 200, r.text
        for w in (p0, p1, d0, d1):  # round robin: each got traffic
            w.wait_received(1)

        # a P pod going not Ready leaves on that one event; requests keep succeeding on p1
        standin.apply(make_pod("prefill", 0, p0.server.port, "not_ready"))
        wait_until(lambda: p0.url not in registered(client)["prefill"], "p0 to leave")
        before, before_p1 = len(p0.received), len(p1.received)
        for i in range(3):
            r = client.post("/generate", json={"text": f"after {i}", "sampling_params": {}})
            assert r.status_code == 200, r.text
        p1.wait_received(before_p1 + 3)
        assert len(p0.received) == before

        # 410 Gone: both watchers re-list; no worker is removed or re-created
        kept = {w.url: w for w in registry}
        lists = standin.count("list")
        standin.compact()
        wait_until(lambda: standin.count("list") >= lists + 2, "a re-list per role")
        snap = wait_until(lambda: (s := client.get("/service_discovery").json())["prefill"]["gone"]
                          and s["decode"]["gone"] and s, "the 410s to be counted")
        assert snap["prefill"]["lists"] >= 2 and snap["decode"]["lists"] >= 2
        assert {w.url: w for w in registry} == kept
        assert all(registry.get(u) is w for u, w in kept.items())  # the same Worker objects

        # the watch goes on after the re-list: a deletion mark, then DELETED
        standin.apply(make_pod("decode", 1, d1.server.port, "terminating"))
        wait_until(lambda: d1.url not in registered(client)["decode"], "terminating d1 to leave")
        standin.delete(make_pod("decode", 1, d1.server.port)["metadata"]["name"])
        standin.apply(make_pod("prefill", 0, p0.server.port))  # back to Ready: joins again
        wait_until(lambda: available(client) == {"prefill": {p0.url, p1.url},
                                                 "decode": {d0.url}}, "p0 back, d1 gone")
        r = client.post("/generate", json={"text": "end", "sampling_params": {}})
        assert r.status_code == 200, r.text
    finally:
        client.close()
        server.stop()


def test_api_outage_keeps_workers_and_recovers(tmp_path, monkeypatch, fake_worker) -> None:
    """The API server going away must not empty the pools; the watch backs off and re-lists."""
    p0, d0 = fake_worker("prefill"), fake_worker("decode")
    api = KubeStandIn().start()
    monkeypatch.setenv("KUBECONFIG", str(api.kubeconfig(tmp_path / "kubeconfig")))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    api.apply(make_pod("prefill", 0, p0.server.port))
    api.apply(make_pod("decode", 0, d0.server.port))
    config = RouterConfig(pd_disaggregation=True, service_discovery=True,
                          service_discovery_namespace="pdserve", health_check_interval_secs=1,
                          **SELECTORS)
    app = create_app(config)
    server = ServerThread(app).start()
    client = httpx.Client(base_url=server.url, timeout=20)
    try:
        wait_until(lambda: available(client) == {"prefill": {p0.url}, "decode": {d0.url}},
                   "the pods to join")
        api.stop()  # the API server is gone: connection refused on every call
        snap = wait_until(lambda: (s := client.get("/service_discovery").json())["prefill"][
            "errors"] and s, "the watcher to notice", timeout=30)
        assert snap["prefill"]["last_error"]
        assert available(client) == {"prefill": {p0.url}, "decode": {d0.url}}
        r = client.post("/generate", json={"text": "still", "sampling_params": {}})
        assert r.status_code == 200, r.text
    finally:
        client.close()
        server.stop()


def test_bad_annotations_resync_and_all_namespaces(standin, fake_worker, monkeypatch) -> None:
    """A pod whose port annotations are not ports is seen but never a worker; without
    --service-discovery-namespace the watch covers every namespace (/api/v1/pods); a watch that
    reaches its timeout ends in a fresh list (resync) without churn."""
    from pdcore.router import discovery

    monkeypatch.setattr(discovery, "RESYNC_SECS", 1.0)
    p0, d0 = fake_worker("prefill"), fake_worker("decode")
    bad = make_pod("prefill", 1, p0.server.port)
    bad["metadata"]["annotations"]["sglang.ai/bootstrap-port"] = "bootstrap"
    bad_port = make_pod("decode", 2, d0.server.port)
    bad_port["metadata"]["annotations"]["pdserve.ai/port"] = "70000"
    for pod in (make_pod("prefill", 0, p0.server.port), make_pod("decode", 0, d0.server.port),
                bad, bad_port):
        standin.apply(pod)
    config = RouterConfig(pd_disaggregation=True, service_discovery=True,
                          health_check_interval_secs=1, **SELECTORS)
    app = create_app(config)
    server = ServerThread(app).start()
    client = httpx.Client(base_url=server.url, timeout=20)
    try:
        wait_until(lambda: available(client) == {"prefill": {p0.url}, "decode": {d0.url}},
                   "the good pods to join")
        snap = client.get("/service_discovery").json()
        assert snap["prefill"]["pods"][f"pdserve/{bad['metadata']['name']}"]["url"] is None
        assert snap["decode"]["pods"][f"pdserve/{bad_port['metadata']['name']}"]["url"] is None
        kept = {w.url: w for w in app.state.router.registry}
        lists = standin.count("list")
        wait_until(lambda: standin.count("list") >= lists + 2, "a resync list per role")
        assert client.get("/service_discovery").json()["prefill"]["gone"] == 0
        assert all(r.split()[2] == "*" for r in standin.requests)  # /api/v1/pods every time
        assert {w.url: w for w in app.state.router.registry} == kept  # the same Worker objects
    finally:
        client.close()
        server.stop()


def test_forbidden_is_reported_and_retried(standin, tmp_path, monkeypatch) -> None:
    """A token the API refuses (RBAC not applied yet, say): the router serves, reports the
    error per role, keeps retrying with back-off, and has no workers (health 503)."""
    cfg_path = standin.kubeconfig(tmp_path / "bad")
    cfg_path.write_text(cfg_path.read_text().replace("standin-token", "wrong-token"))
    monkeypatch.setenv("KUBECONFIG", str(cfg_path))
    app = create_app(RouterConfig(pd_disaggregation=True, service_discovery=True,
                                  service_discovery_namespace="pdserve", **SELECTORS))
    server = ServerThread(app).start()
    client = httpx.Client(base_url=server.url, timeout=20)
    try:
        snap = wait_until(lambda: (s := client.get("/service_discovery").json())["prefill"][
            "errors"] and s["decode"]["errors"] and s, "both watchers to report the refusal")
        assert "401" in snap["prefill"]["last_error"], snap
        assert client.get("/health").status_code == 503
        assert client.get("/workers").json()["total"] == 0
    finally:
        client.close()
        server.stop()


def _router_cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pdcore.router", *args], env=env, check=False,
                          capture_output=True, text=True, timeout=60)


def test_no_credentials_exits_2(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items()
           if k not in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT")}
    env["HOME"] = str(tmp_path)  # no ~/.kube/config
    r = _router_cli(["--service-discovery", "--prefill-selector", "role=prefill",
                     "--decode-selector", "role=decode"], env)
    assert r.returncode == 2, r.stderr
    assert "no cluster credentials" in r.stderr and "KUBECONFIG" in r.stderr


@pytest.mark.parametrize(("argv", "message"), [
    (["--service-discovery", "--prefill-selector", "role=prefill"], "--decode-selector"),
    (["--service-discovery", "--prefill-selector", "role", "--decode-selector", "r=d"],
     "write key=value"),
    (["--service-discovery", "--prefill-selector", "--decode-selector", "r=d"], "needs one or"),
    (["--service-discovery", "--prefill-selector", "a=b", "--decode-selector", "a=b"],
     "same pods"),
    (["--prefill-selector", "a=b", "--prefill", "http://127.0.0.1:1", "--decode",
      "http://127.0.0.1:2"], "with --service-discovery only"),
])
def test_discovery_flag_errors(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_router_args(argv)


def test_selector_flags_parse_as_sglang_router() -> None:
    cfg = parse_router_args([
        "--service-discovery", "--selector", "app=pdserve", "--prefill-selector", "role=prefill",
        "tier=gpu", "--decode-selector", "role=decode,tier=gpu", "--service-discovery-port",
        "30000", "--service-discovery-namespace", "inference"])
    assert cfg.prefill_selector == {"role": "prefill", "tier": "gpu"}
    assert cfg.decode_selector == {"role": "decode", "tier": "gpu"}
    assert cfg.selector == {"app": "pdserve"}
    assert cfg.service_discovery_port == 30000 and cfg.service_discovery_namespace == "inference"
    assert cfg.bootstrap_port_annotation == "sglang.ai/bootstrap-port"
    assert cfg.prefill == [] and cfg.decode == []

