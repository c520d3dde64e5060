"""Kubernetes service discovery: prefill and decode workers are the Ready pods of two selectors.

Flags and meaning follow sglang-router: `--service-discovery`, `--prefill-selector K=V ...`,
`--decode-selector K=V ...`, `--selector K=V ...` (pdserve routes PD only, so these labels are
added to both role selectors), `--service-discovery-port` (the worker port on every pod),
`--service-discovery-namespace` (unset: all namespaces) and the prefill pod annotation
`sglang.ai/bootstrap-port` (`--bootstrap-port-annotation`). pdserve also reads `pdserve.ai/port`
on a pod, which overrides the port for that pod (pods sharing one IP, as in the tests).

One thread per role runs the official `kubernetes` client: list, then watch from the list's
resourceVersion; the watch ends after `resync_secs` (a fresh list, so a missed event heals), a
410 Gone (ERROR event or exception) forces a re-list at once, any other failure backs off
exponentially (the workers stay as they are meanwhile: an API outage must not empty the pools).
After every list or event the thread posts its role's full desired set (URL -> bootstrap port of
each Ready pod) to the event loop, which reconciles the registry: a pod that became Ready joins
(after its first healthy /health, as any added worker), one that stopped being Ready or was
deleted leaves at once; its in-flight requests then fail over as the router's retry rules say.
The `kubernetes` package is imported lazily: the core does not need it (`pdcore[kubernetes]`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pdcore.env import ENV
from pdcore.errors import ConfigError

if TYPE_CHECKING:
    from pdcore.router.config import RouterConfig
    from pdcore.router.health import HealthMonitor
    from pdcore.router.workers import Worker, WorkerRegistry

log = logging.getLogger("pdcore.router.discovery")

SELECTOR_FLAGS = ("selector", "prefill-selector", "decode-selector")
PORT_ANNOTATION = "pdserve.ai/port"
RESYNC_SECS = 300.0
BACKOFF_MIN_SECS, BACKOFF_MAX_SECS = 1.0, 30.0
_INSTALL_HINT = "pip install 'pdcore[kubernetes]'"


def parse_selector(flag: str, tokens: Sequence[str]) -> dict[str, str]:
    """`k=v` tokens (space- or comma-separated, as sglang-router and kubectl write them)."""
    items = [p for t in tokens for p in t.replace(",", " ").split() if p]
    if not items:
        raise ConfigError(f"--{flag} needs one or more labels: --{flag} key=value [key=value ...]")
    out: dict[str, str] = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"--{flag}: {item!r} is not a label; write key=value")
        out[key.strip()] = value.strip()
    return out


def selector_string(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in labels.items())


def load_cluster_config() -> Any:
    """A kubernetes `Configuration`: in-cluster when in a pod, else the kubeconfig.

    ConfigError (exit 2 at the CLI) when the client is missing or no credentials are found."""
    try:
        from kubernetes import client, config
    except ImportError:
        raise ConfigError(f"--service-discovery needs the kubernetes client: {_INSTALL_HINT}") \
            from None
    cfg = client.Configuration()
    if ENV.kubernetes_service_host:
        try:
            config.load_incluster_config(client_configuration=cfg)
            return cfg
        except config.ConfigException as exc:
            raise ConfigError(f"--service-discovery: in-cluster credentials unusable: {exc}; "
                              "check the pod's service account token mount") from None
    # read KUBECONFIG now: the client's default path was fixed when it was first imported
    where = ENV.kubeconfig or os.path.expanduser("~/.kube/config")
    try:
        config.load_kube_config(config_file=where, client_configuration=cfg)
    except (config.ConfigException, OSError, TypeError) as exc:
        raise ConfigError(
            "--service-discovery found no cluster credentials: not running in a pod "
            f"(KUBERNETES_SERVICE_HOST unset) and no usable kubeconfig at {where} ({exc}); run "
            "the router in the cluster with a service account that may list/watch pods, or "
            "point KUBECONFIG at a kubeconfig") from None
    return cfg


@dataclass
class PodView:
    name: str
    url: str | None  # None: no IP yet or a bad port annotation
    ready: bool
    bootstrap_port: int | None


def _port_of(value: str | None, what: str, pod: str) -> int | None:
    if value is None:
        return None
    try:
        port = int(value)
    except ValueError:
        port = 0
    if not 0 < port < 65536:
        log.warning("pod %s: %s %r is not a port; ignoring the pod", pod, what, value)
        raise ValueError(value)
    return port


def pod_view(pod: Any, role: str, port: int, bootstrap_annotation: str) -> PodView:
    """The worker a `V1Pod` stands for: Ready = phase Running and the Ready condition True and
    not being deleted (sglang-router's rule, plus the deletion mark it also honours)."""
    meta, status = pod.metadata, pod.status
    name = f"{meta.namespace}/{meta.name}"
    ann = meta.annotations or {}
    conditions = (status.conditions if status else None) or []
    ready = (status is not None and status.phase == "Running" and meta.deletion_timestamp is None
             and any(c.type == "Ready" and c.status == "True" for c in conditions))
    ip = status.pod_ip if status else None
    try:
        port = _port_of(ann.get(PORT_ANNOTATION), PORT_ANNOTATION, name) or port
        bport = (_port_of(ann.get(bootstrap_annotation), bootstrap_annotation, name)
                 if role == "prefill" else None)
    except ValueError:
        return PodView(name, None, False, None)
    host = f"[{ip}]" if ip and ":" in ip else ip
    return PodView(name, f"http://{host}:{port}" if ip else None, ready, bport)


@dataclass
class RoleState:
    """What one role's watcher saw; served by GET /service_discovery."""

    selector: str
    pods: dict[str, PodView] = field(default_factory=dict)  # uid -> view
    lists: int = 0
    watch_events: int = 0
    gone: int = 0  # 410s that forced a re-list
    errors: int = 0
    last_error: str | None = None

    def desired(self) -> dict[str, int | None]:
        return {p.url: p.bootstrap_port for p in self.pods.values() if p.ready and p.url}


class ServiceDiscovery:
    """Keeps the registry's discovered workers equal to the Ready pods of each role."""

    def __init__(self, config: RouterConfig, registry: WorkerRegistry,
                 monitor: HealthMonitor | None, resync_secs: float | None = None) -> None:
        self._config, self._registry, self._monitor = config, registry, monitor
        self._resync = RESYNC_SECS if resync_secs is None else resync_secs
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._watches: list[Any] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self.roles = {r: RoleState(selector_string(s)) for r, s in config.role_selectors().items()}
        self.tracked: dict[str, dict[str, Worker]] = {"prefill": {}, "decode": {}}

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        from kubernetes import client

        self._loop = loop
        api = client.CoreV1Api(client.ApiClient(load_cluster_config()))
        for role in self.roles:
            t = threading.Thread(target=self._run, args=(api, role), daemon=True,
                                 name=f"router-discovery-{role}")
            self._threads.append(t)
            t.start()
        log.info("service discovery: namespace %s, prefill %r, decode %r, port %d",
                 self._config.service_discovery_namespace or "(all)",
                 self.roles["prefill"].selector, self.roles["decode"].selector,
                 self._config.service_discovery_port)

    def stop(self, timeout: float = 0.5) -> None:
        self._stop.set()
        for w in list(self._watches):
            w.stop()
        for t in self._threads:
            # a watch blocked in a read ends at its server timeout; the thread is a daemon
            t.join(timeout)

    def snapshot(self) -> dict[str, object]:
        # list(...) copies each watcher's dict in one C call, safe against its thread's writes
        return {role: {"selector": s.selector, "lists": s.lists, "watch_events": s.watch_events,
                       "gone": s.gone, "errors": s.errors, "last_error": s.last_error,
                       "pods": {p.name: {"url": p.url, "ready": p.ready,
                                         "bootstrap_port": p.bootstrap_port}
                                for p in list(s.pods.values())},
                       "workers": sorted(self.tracked[role])}
                for role, s in self.roles.items()}

    # ---- watcher thread -------------------------------------------------------------------
    def _list_call(self, api: Any) -> tuple[Any, tuple[Any, ...]]:
        ns = self._config.service_discovery_namespace
        if ns:
            return api.list_namespaced_pod, (ns,)
        return api.list_pod_for_all_namespaces, ()

    def _run(self, api: Any, role: str) -> None:
        from kubernetes import watch
        from kubernetes.client.rest import ApiException

        state = self.roles[role]
        backoff = BACKOFF_MIN_SECS
        list_fn, args = self._list_call(api)
        while not self._stop.is_set():
            try:
                rv = self._list(list_fn, args, role)
                backoff = BACKOFF_MIN_SECS
                w = watch.Watch()
                self._watches.append(w)
                try:
                    self._watch(w, list_fn, args, role, rv)
                finally:
                    self._watches.remove(w)
            except ApiException as exc:
                if exc.status == 410:
                    state.gone += 1
                    log.info("%s watch: 410 Gone (%s); re-listing", role, exc.reason)
                    continue
                backoff = self._failed(state, role, f"HTTP {exc.status}: {exc.reason}", backoff)
            except Exception as exc:  # noqa: BLE001 - any client/network failure: back off
                if self._stop.is_set():
                    return
                backoff = self._failed(state, role, f"{type(exc).__name__}: {exc}", backoff)

    def _failed(self, state: RoleState, role: str, error: str, backoff: float) -> float:
        state.errors += 1
        state.last_error = error
        delay = backoff * random.uniform(0.8, 1.2)
        log.warning("%s discovery: %s; retrying in %.1f s (workers kept)", role, error, delay)
        self._stop.wait(delay)
        return min(backoff * 2, BACKOFF_MAX_SECS)

    def _list(self, list_fn: Any, args: tuple[Any, ...], role: str) -> str:
        state = self.roles[role]
        pods = list_fn(*args, label_selector=state.selector, _request_timeout=30)
        cfg = self._config
        state.pods = {p.metadata.uid: pod_view(p, role, cfg.service_discovery_port,
                                               cfg.bootstrap_port_annotation)
                      for p in pods.items}
        state.lists += 1
        self._post(role)
        return pods.metadata.resource_version

    def _watch(self, w: Any, list_fn: Any, args: tuple[Any, ...], role: str, rv: str) -> None:
        from kubernetes.client.rest import ApiException

        state, cfg = self.roles[role], self._config
        deadline = time.monotonic() + self._resync
        stream = w.stream(list_fn, *args, label_selector=state.selector, resource_version=rv,
                          timeout_seconds=max(1, int(self._resync)),
                          _request_timeout=(10, self._resync + 30))
        for event in stream:
            if self._stop.is_set():
                return
            kind, obj = event["type"], event["object"]
            if kind == "ERROR":  # older clients yield the Status instead of raising
                raw = event.get("raw_object") or {}
                raise ApiException(status=raw.get("code", 500), reason=raw.get("message"))
            if kind == "BOOKMARK":
                continue
            state.watch_events += 1
            uid = obj.metadata.uid
            if kind == "DELETED":
                state.pods.pop(uid, None)
            else:
                state.pods[uid] = pod_view(obj, role, cfg.service_discovery_port,
                                           cfg.bootstrap_port_annotation)
            self._post(role)
            if time.monotonic() > deadline:
                return  # resync: a fresh list
        # the server ended the watch (its timeoutSeconds): re-list

    def _post(self, role: str) -> None:
        desired = self.roles[role].desired()
        if self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._reconcile, role, desired)
            except RuntimeError:  # the loop closed between the check and the call
                pass

    # ---- event loop side ------------------------------------------------------------------
    def _reconcile(self, role: str, desired: dict[str, int | None]) -> None:
        """Registry := desired for this role's discovered workers (event loop thread)."""
        from pdcore.router.workers import DuplicateWorkerError

        tracked = self.tracked[role]
        for url, worker in list(tracked.items()):
            # the server's entry, or its DP-rank entries once --dp-aware expanded it
            registered = self._registry.get(url) is not None
            if url in desired and desired[url] == worker.bootstrap_port and registered:
                continue
            del tracked[url]
            if registered:
                self._registry.remove(url)
                log.info("%s worker %s left (pod not Ready, deleted or changed)", role, url)
        for url, bport in desired.items():
            if url in tracked:
                continue
            mini = self._config.mini_lb
            try:
                worker = self._registry.add(url, role, bport, healthy=mini)
            except DuplicateWorkerError:
                log.warning("pod worker %s is registered already (by a flag or POST /workers); "
                            "discovery leaves it alone", url)
                continue
            except ConfigError as exc:
                log.warning("pod worker %s refused: %s", url, exc)
                continue
            tracked[url] = worker
            log.info("%s worker %s joined (pod Ready)", role, url)
            if self._monitor is not None and not mini:
                self._monitor.watch_startup(worker)
