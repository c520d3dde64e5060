"""Writes the Kubernetes API objects the discovery stand-in serves (run: python3 make_fixtures.py).

Every object is built from the official `kubernetes` client's models and serialized by its own
`ApiClient.sanitize_for_serialization`, i.e. the JSON the API server sends: a Deployment's pod as
`kubectl get pod -o json` shows it (ReplicaSet owner, projected token volume, kubelet conditions),
its not-Ready state after a failed readiness probe, its terminating state (deletionTimestamp), a
PodList envelope and the `Status` of a watch's 410 Gone (reason Expired). The tests patch only
what differs per run: names, uids, the port annotations (their servers' ports). Written with
kubernetes 37 (its models take `host_ips`/`pod_ips`; older clients spell them `host_i_ps`).
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

from kubernetes import client as k

HERE = Path(__file__).parent
T0 = dt.datetime(2026, 11, 30, 9, 12, 3, tzinfo=dt.timezone.utc)


def _t(seconds: int) -> dt.datetime:
    return T0 + dt.timedelta(seconds=seconds)


def _pod(role: str, ready: bool) -> k.V1Pod:
    rs_hash = "7c9d8f6b5d" if role == "prefill" else "5f6c7d9b84"
    name = f"pdserve-{role}-{rs_hash}-x2x7q"
    ann = {"prometheus.io/scrape": "true", "prometheus.io/port": "30000",
           "prometheus.io/path": "/metrics", "pdserve.ai/port": "30000"}
    if role == "prefill":
        ann["sglang.ai/bootstrap-port"] = "8998"
    cond = "True" if ready else "False"
    not_ready = None if ready else "containers with unready status: [server]"
    reason = None if ready else "ContainersNotReady"
    args = ["serve", "--host", "0.0.0.0", "--port", "30000", "--model-path", "/models/model",
            "--disaggregation-mode", role, "--disaggregation-transfer-backend", "mooncake"]
    if role == "prefill":
        args += ["--disaggregation-bootstrap-port", "8998"]
    probe = k.V1Probe(http_get=k.V1HTTPGetAction(path="/health", port="http", scheme="HTTP"),
                      period_seconds=5, timeout_seconds=5, success_threshold=1,
                      failure_threshold=3)
    return k.V1Pod(
        api_version="v1", kind="Pod",
        metadata=k.V1ObjectMeta(
            name=name, generate_name=name[:-5], namespace="pdserve",
            uid="3f1c2b8e-6a41-4a8e-9f0e-7d2c5b1a9e40", resource_version="48211",
            creation_timestamp=_t(0),
            labels={"app.kubernetes.io/name": "pdserve", "app.kubernetes.io/component": role,
                    "pod-template-hash": rs_hash},
            annotations=ann,
            owner_references=[k.V1OwnerReference(
                api_version="apps/v1", kind="ReplicaSet", name=f"pdserve-{role}-{rs_hash}",
                uid="9b0d7c1e-2f3a-4b5c-8d6e-0f1a2b3c4d5e", controller=True,
                block_owner_deletion=True)]),
        spec=k.V1PodSpec(
            containers=[k.V1Container(
                name="server", image="ghcr.io/example/pdserve:0.1.0", command=["pdserve"],
                args=args, image_pull_policy="IfNotPresent",
                ports=[k.V1ContainerPort(container_port=30000, name="http", protocol="TCP")]
                + ([k.V1ContainerPort(container_port=8998, name="bootstrap", protocol="TCP")]
                   if role == "prefill" else []),
                readiness_probe=probe, liveness_probe=probe,
                resources=k.V1ResourceRequirements(
                    limits={"cpu": "8", "memory": "32Gi", "nvidia.com/gpu": "1"},
                    requests={"cpu": "8", "memory": "32Gi", "nvidia.com/gpu": "1"}),
                termination_message_path="/dev/termination-log",
                termination_message_policy="File",
                volume_mounts=[k.V1VolumeMount(
                    name="kube-api-access-7lq9d", read_only=True,
                    mount_path="/var/run/secrets/kubernetes.io/serviceaccount")])],
            dns_policy="ClusterFirst", enable_service_links=True, node_name="gpu-node-1",
            preemption_policy="PreemptLowerPriority", priority=0, restart_policy="Always",
            scheduler_name="default-scheduler", security_context=k.V1PodSecurityContext(),
            service_account="default", service_account_name="default",
            termination_grace_period_seconds=30,
            tolerations=[k.V1Toleration(key=f"node.kubernetes.io/{t}", operator="Exists",
                                        effect="NoExecute", toleration_seconds=300)
                         for t in ("not-ready", "unreachable")],
            volumes=[k.V1Volume(name="kube-api-access-7lq9d", projected=k.V1ProjectedVolumeSource(
                default_mode=420, sources=[
                    k.V1VolumeProjection(service_account_token=k.V1ServiceAccountTokenProjection(
                        expiration_seconds=3607, path="token")),
                    k.V1VolumeProjection(config_map=k.V1ConfigMapProjection(
                        name="kube-root-ca.crt", items=[k.V1KeyToPath(key="ca.crt",
                                                                      path="ca.crt")])),
                    k.V1VolumeProjection(downward_api=k.V1DownwardAPIProjection(items=[
                        k.V1DownwardAPIVolumeFile(path="namespace", field_ref=k.V1ObjectFieldSelector(
                            api_version="v1", field_path="metadata.namespace"))]))]))]),
        status=k.V1PodStatus(
            phase="Running",
            conditions=[
                k.V1PodCondition(type="PodReadyToStartContainers", status="True",
                                 last_transition_time=_t(4)),
                k.V1PodCondition(type="Initialized", status="True", last_transition_time=_t(1)),
                k.V1PodCondition(type="Ready", status=cond, reason=reason, message=not_ready,
                                 last_transition_time=_t(95 if ready else 400)),
                k.V1PodCondition(type="ContainersReady", status=cond, reason=reason,
                                 message=not_ready, last_transition_time=_t(95 if ready else 400)),
                k.V1PodCondition(type="PodScheduled", status="True", last_transition_time=_t(0)),
            ],
            host_ip="10.0.3.17", host_ips=[k.V1HostIP(ip="10.0.3.17")],
            pod_ip="127.0.0.1", pod_ips=[k.V1PodIP(ip="127.0.0.1")], start_time=_t(1),
            qos_class="Guaranteed",
            container_statuses=[k.V1ContainerStatus(
                name="server", ready=ready, restart_count=0, started=True,
                image="ghcr.io/example/pdserve:0.1.0",
                image_id="ghcr.io/example/pdserve@sha256:" + "4e1f" * 16,
                container_id="containerd://" + "a3b1c9" * 10 + "a3b1",
                state=k.V1ContainerState(running=k.V1ContainerStateRunning(started_at=_t(3))))]))


def main() -> None:
    ser = k.ApiClient().sanitize_for_serialization
    out = {
        "pod_prefill_ready.json": _pod("prefill", True),
        "pod_prefill_not_ready.json": _pod("prefill", False),
        "pod_decode_ready.json": _pod("decode", True),
        "pod_list_empty.json": k.V1PodList(api_version="v1", kind="PodList", items=[],
                                           metadata=k.V1ListMeta(resource_version="48230")),
        "status_gone.json": k.V1Status(
            api_version="v1", kind="Status", metadata=k.V1ListMeta(), status="Failure",
            message="too old resource version: 48211 (48397)", reason="Expired", code=410),
    }
    term = _pod("decode", True)
    term.metadata.deletion_timestamp = _t(900)
    term.metadata.deletion_grace_period_seconds = 30
    out["pod_decode_terminating.json"] = term
    for name, obj in out.items():
        text = json.dumps(ser(obj), indent=1, sort_keys=True)
        # the API writes RFC 3339 UTC times with "Z"; the client's isoformat gives "+00:00"
        (HERE / name).write_text(text.replace('+00:00"', 'Z"') + "\n")


if __name__ == "__main__":
    main()
