"""The Kubernetes manifests (deploy/kubernetes, Kustomize): what `kubectl kustomize` renders for
every overlay validates against the Kubernetes API schemas (kubernetes-validate, strict, the
newest Kubernetes release it knows), passes checkov (test_checkov.py), and says what pdserve
understands: the router's and servers' args parse with pdserve's own parsers, the router's
selectors select exactly the P and D pod templates, the prefill pods announce the bootstrap port
they serve, the RBAC grants list/watch on pods and nothing else, every server has /health probes,
resources and Prometheus annotations.

LeaderWorkerSet is a CRD that kubernetes-validate has no schema for: its two pod templates are
validated as core `PodTemplate`s instead, and its own fields are checked here by hand.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

yaml = pytest.importorskip("yaml")
kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")

from pdcore.config import ServerArgs
from pdcore.router.cli import parse_router_args
from pdcore.server.startup.args_parser import build_parser

ROOT = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
OVERLAYS = sorted(p.name for p in (ROOT / "overlays").iterdir() if p.is_dir())
K8S_VERSION = kv.latest_version()
SERVER_ROLES = ("prefill", "decode")


def render(overlay: str) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not on PATH (its built-in kustomize renders the manifests)")
    out = subprocess.run([kubectl, "kustomize", str(ROOT / "overlays" / overlay)],
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.fixture(scope="module", params=OVERLAYS)
def docs(request) -> tuple[str, list[dict[str, Any]]]:
    return request.param, render(request.param)


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def pod_templates(docs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """(owner name, pod template) of every Deployment and LeaderWorkerSet group member."""
    out = []
    for d in docs:
        if d["kind"] == "Deployment":
            out.append((d["metadata"]["name"], d["spec"]["template"]))
        elif d["kind"] == "LeaderWorkerSet":
            lwt = d["spec"]["leaderWorkerTemplate"]
            out.append((d["metadata"]["name"] + "/leader", lwt["leaderTemplate"]))
            out.append((d["metadata"]["name"] + "/worker", lwt["workerTemplate"]))
    return out


def expand(args: list[str], env: dict[str, str]) -> list[str]:
    """Kubernetes' $(VAR) expansion of container args."""
    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env[m.group(1)], a) for a in args]


def container_env(docs: list[dict[str, Any]], container: dict[str, Any]) -> dict[str, str]:
    env: dict[str, str] = {}
    maps = {m["metadata"]["name"]: m.get("data", {}) for m in by_kind(docs, "ConfigMap")}
    for src in container.get("envFrom", []):
        env.update(maps[src["configMapRef"]["name"]])
    for e in container.get("env", []):
        env[e["name"]] = e.get("value", f"<{e['name']}>")
    return env


def labels_match(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_overlays_exist() -> None:
    assert {"1p1d", "xpyd", "nixl", "lws-tp", "mooncake-rdma"} <= set(OVERLAYS)


def test_validates_against_kubernetes_schemas(docs) -> None:
    _name, rendered = docs
    for d in rendered:
        if d["kind"] == "LeaderWorkerSet":
            continue  # a CRD: its pod templates are validated in the next test
        kv.validate(d, K8S_VERSION, strict=True)  # raises ValidationError naming the field


def test_leaderworkerset_templates_and_fields(docs) -> None:
    name, rendered = docs
    lws = by_kind(rendered, "LeaderWorkerSet")
    if name != "lws-tp":
        assert not lws
        return
    assert {d["metadata"]["name"] for d in lws} == {"pdserve-prefill", "pdserve-decode"}
    assert not [d for d in by_kind(rendered, "Deployment")
                if d["metadata"]["name"] != "pdserve-router"]
    for d in lws:
        assert d["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
        spec = d["spec"]
        lwt = spec["leaderWorkerTemplate"]
        assert set(spec) <= {"replicas", "leaderWorkerTemplate", "rolloutStrategy",
                             "startupPolicy", "networkConfig"}
        assert spec["startupPolicy"] in ("LeaderCreated", "LeaderReady")
        assert lwt["restartPolicy"] in ("RecreateGroupOnPodRestart", "None")
        assert isinstance(lwt["size"], int) and lwt["size"] >= 2
        for part in ("leaderTemplate", "workerTemplate"):
            kv.validate({"apiVersion": "v1", "kind": "PodTemplate",
                         "metadata": {"name": f"{d['metadata']['name']}-{part}"},
                         "template": lwt[part]}, K8S_VERSION, strict=True)


def test_server_args_parse_and_announce(docs) -> None:
    """Every server container's args (after $(VAR) expansion) are valid `pdserve serve` flags;
    multi-node ones take --nnodes/--node-rank/--dist-init-addr from the LWS environment."""
    name, rendered = docs
    lws_env = {"LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "1",
               "LWS_LEADER_ADDRESS": "pdserve-prefill-0.pdserve-prefill.pdserve"}
    seen = set()
    for owner, tmpl in pod_templates(rendered):
        if owner == "pdserve-router":
            continue
        (c,) = tmpl["spec"]["containers"]
        assert c["command"] == ["pdserve"] and c["args"][0] == "serve"
        raw = c["args"][1:]
        argv = expand(raw, {**container_env(rendered, c), **lws_env})
        ns = build_parser().parse_args(argv)
        args = ServerArgs(**vars(ns))
        args.validate()
        role = args.disaggregation_mode
        seen.add(role)
        labels = tmpl["metadata"]["labels"]
        if "/worker" in owner:
            assert "$(LWS_WORKER_INDEX)" in raw and labels["app.kubernetes.io/component"] \
                == f"{role}-worker"
            continue
        assert labels["app.kubernetes.io/component"] == role
        if name == "lws-tp":
            assert (args.nnodes, args.node_rank) == (2, 1)
            assert args.dist_init_addr == lws_env["LWS_LEADER_ADDRESS"] + ":20000"
        ann = tmpl["metadata"]["annotations"]
        assert ann["prometheus.io/scrape"] == "true"
        assert ann["prometheus.io/port"] == str(args.port) == "30000"
        if role == "prefill":
            assert ann["sglang.ai/bootstrap-port"] == str(args.disaggregation_bootstrap_port)
        for probe in ("readinessProbe", "livenessProbe"):
            assert c[probe]["httpGet"]["path"] == "/health"
        for kind in ("requests", "limits"):
            assert {"cpu", "memory", "nvidia.com/gpu"} <= set(c["resources"][kind])
        expect_backend = "nixl" if name == "nixl" else "mooncake"
        assert args.disaggregation_transfer_backend == expect_backend
        if name == "mooncake-rdma":
            assert args.disaggregation_ib_device == "mlx5_0"
            assert "IPC_LOCK" in c["securityContext"]["capabilities"]["add"]
    assert seen == set(SERVER_ROLES)


def test_router_discovers_the_server_pods(docs) -> None:
    """The router's flags parse as `pdserve router` flags, and its selectors pick exactly the
    serving pods of each role (not the LWS workers, not the router)."""
    _name, rendered = docs
    (router,) = [d for d in by_kind(rendered, "Deployment")
                 if d["metadata"]["name"] == "pdserve-router"]
    (c,) = router["spec"]["template"]["spec"]["containers"]
    assert c["command"] == ["pdserve"] and c["args"][0] == "router"
    cfg = parse_router_args(expand(c["args"][1:], {"POD_NAMESPACE": "pdserve"}))
    assert cfg.service_discovery and cfg.service_discovery_namespace == "pdserve"
    assert c["readinessProbe"]["httpGet"]["path"] == "/readiness"
    assert c["livenessProbe"]["httpGet"]["path"] == "/liveness"
    for role in SERVER_ROLES:
        selector = {**cfg.selector, **getattr(cfg, f"{role}_selector")}
        picked = [owner for owner, t in pod_templates(rendered)
                  if labels_match(selector, t["metadata"]["labels"])]
        assert picked in ([f"pdserve-{role}"], [f"pdserve-{role}/leader"]), picked
    (svc,) = by_kind(rendered, "Service")
    assert labels_match(svc["spec"]["selector"], router["spec"]["template"]["metadata"]["labels"])
    assert svc["spec"]["ports"][0]["port"] == cfg.port


def test_rbac_is_list_watch_pods_only(docs) -> None:
    _name, rendered = docs
    (role,) = by_kind(rendered, "Role")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"],
                              "verbs": ["list", "watch"]}]
    assert not by_kind(rendered, "ClusterRole") and not by_kind(rendered, "ClusterRoleBinding")
    (binding,) = by_kind(rendered, "RoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    (subject,) = binding["subjects"]
    for owner, tmpl in pod_templates(rendered):
        spec = tmpl["spec"]
        if owner == "pdserve-router":
            assert spec["serviceAccountName"] == subject["name"]
        else:  # servers get no API token at all
            assert spec["serviceAccountName"] != subject["name"]
            assert spec["automountServiceAccountToken"] is False


def test_xpyd_counts() -> None:
    rendered = render("xpyd")
    replicas = {d["metadata"]["name"]: d["spec"]["replicas"] for d in by_kind(rendered, "Deployment")}
    assert replicas == {"pdserve-prefill": 2, "pdserve-decode": 4, "pdserve-router": 2}


def test_two_routers_that_a_rollout_never_leaves_fewer_of(docs) -> None:
    """#49: the router is not the single point: two replicas behind the one Service, a rolling
    update that starts a new one before it stops an old one, spread over nodes."""
    _name, rendered = docs
    (router,) = [d for d in by_kind(rendered, "Deployment")
                 if d["metadata"]["name"] == "pdserve-router"]
    spec = router["spec"]
    assert spec["replicas"] >= 2
    assert spec["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    anti = spec["template"]["spec"]["affinity"]["podAntiAffinity"]
    [term] = anti["preferredDuringSchedulingIgnoredDuringExecution"]
    assert labels_match(term["podAffinityTerm"]["labelSelector"]["matchLabels"],
                        spec["template"]["metadata"]["labels"])


def test_every_process_reads_both_secrets_from_a_mounted_secret(docs) -> None:
    """#44: the cluster secret and the admin key reach the router and every server as files of
    the Secret pdserve-cluster mounted read-only (never as environment values: checkov's
    CKV_K8S_35), so the admin routes are on and the router's admin calls are accepted."""
    _name, rendered = docs
    for owner, tmpl in pod_templates(rendered):
        (c,) = tmpl["spec"]["containers"]
        env = {e["name"]: e for e in c.get("env", [])}
        mounts = {m["name"]: m for m in c.get("volumeMounts", [])}
        volumes = {v["name"]: v for v in tmpl["spec"].get("volumes", [])}
        for var, key in (("PDSERVE_DISAGGREGATION_AUTH_TOKEN_FILE", "token"),
                         ("PDSERVE_ADMIN_API_KEY_FILE", "admin-key")):
            assert var in env, (owner, var)
            path = env[var]["value"]
            (mount,) = [m for m in mounts.values() if path == f"{m['mountPath']}/{key}"]
            assert mount["readOnly"] is True
            assert volumes[mount["name"]]["secret"]["secretName"] == "pdserve-cluster"
        assert not any("valueFrom" in e and "secretKeyRef" in e["valueFrom"]
                       for e in env.values()), owner
