"""The Grafana dashboard (deploy/grafana/pdserve.json) and the alert rules
(deploy/prometheus/pdserve-rules.yml) against a real Prometheus.

A Prometheus of our own (the system's binary, its own config and TSDB in a temp folder, a free
loopback port; no system service involved) scrapes the shared 1P1D cluster's prefill, decode
and router every second. After a short load, every panel's query and every template variable's
query must return data, and every metric a query names must be one the cluster exports. The
rules file passes `promtool check rules`, its unit tests pass `promtool test rules`, and the
running Prometheus evaluates every rule without error.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdcore.runtime.lifeline import preexec_die_with_parent
from pdcore.testing.processes import PDCluster, free_port

from .obs_helpers import send_load
from .panel_plot import plot_panels

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "pdserve.json"
RULES = REPO / "deploy" / "prometheus" / "pdserve-rules.yml"
RULES_TEST = REPO / "deploy" / "prometheus" / "pdserve-rules.test.yml"
PROMETHEUS, PROMTOOL = shutil.which("prometheus"), shutil.which("promtool")
needs_prometheus = pytest.mark.skipif(
    PROMETHEUS is None or PROMTOOL is None,
    reason="no prometheus/promtool on PATH: apt-get install prometheus (scripts/setup.sh --apt)")
# what Grafana fills in for the dashboard's variables ($instance etc. are multi-value, "All")
VARIABLES = {"$__rate_interval": "1m", "$__interval": "5s", "$__range": "5m",
             "$instance": ".*", "$model_name": ".*", "$job": ".*"}
DATA_TIMEOUT_S = 90.0
RELOAD_EVERY_S = 15.0


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])  # a collapsed row holds its panels


def expand(expr: str) -> str:
    for var, value in sorted(VARIABLES.items(), key=lambda kv: -len(kv[0])):
        expr = expr.replace("${" + var[1:] + "}", value).replace(var, value)
    assert "$" not in expr, f"a variable the test does not know in {expr!r}"
    return expr


def dashboard_queries() -> dict[str, str]:
    """title/refId -> PromQL of every panel target and every query variable."""
    board = json.loads(DASHBOARD.read_text())
    out = {}
    for panel in panels(board):
        for target in panel.get("targets", []):
            out[f"{panel['title']} / {target['refId']}"] = expand(target["expr"])
    for var in board.get("templating", {}).get("list", []):
        if var.get("type") != "query":
            continue
        q = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", q.strip())
        assert m, f"variable {var['name']}: only label_values(metric, label) is used: {q}"
        out[f"variable {var['name']}"] = f"count by ({m.group(2)}) ({expand(m.group(1))})"
    return out


def dashboard_panels() -> list[tuple[str, list[tuple[str, str]]]]:
    """(title, [(PromQL, legend format)]) of every panel, in the dashboard's order."""
    board = json.loads(DASHBOARD.read_text())
    return [(p["title"], [(expand(t["expr"]), t.get("legendFormat", "")) for t in p["targets"]])
            for p in panels(board) if p.get("targets")]


_NOT_METRICS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and",
                "or", "unless", "offset", "le", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression reads (identifiers not followed by '(' and not
    keywords, label names or durations)."""
    expr = re.sub(r'"[^"]*"', '""', expr)  # label values
    expr = re.sub(r"\{[^}]*\}", "", expr)  # matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", expr):
        word, rest = m.group(0), expr[m.end():].lstrip()
        if rest.startswith("(") or word.lower() in _NOT_METRICS:
            continue
        names.add(word)
    return names


def exported_families(urls: list[str]) -> set[str]:
    """Every sample name the servers expose (with _total, _bucket, ... as scraped)."""
    names = set()
    for url in urls:
        text = httpx.get(url + "/metrics", timeout=30).text
        for family in text_string_to_metric_families(text):
            names.add(family.name)
            names.update(s.name for s in family.samples)
            if family.type == "counter":
                names.add(family.name + "_total")
            if family.type == "histogram":
                names.update(family.name + s for s in ("_bucket", "_sum", "_count"))
    return names


class Prometheus:
    """The system's prometheus binary with its own config and TSDB under `workdir`, on a free
    loopback port, killed with the test process (PR_SET_PDEATHSIG)."""

    def __init__(self, workdir: Path, cluster: PDCluster) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        jobs = {"pdserve-prefill": cluster.prefills, "pdserve-decode": cluster.decodes,
                "pdserve-router": [cluster.router]}
        scrape = [{"job_name": job, "static_configs": [
            {"targets": [s.url.removeprefix("http://") for s in servers]}]}
            for job, servers in jobs.items()]
        config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                  "rule_files": [str(RULES)], "scrape_configs": scrape}
        (workdir / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
        self.log_path = workdir / "prometheus.log"
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [str(PROMETHEUS), f"--config.file={workdir / 'prometheus.yml'}",
                 f"--storage.tsdb.path={workdir / 'tsdb'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=preexec_die_with_parent(signal.SIGKILL))  # noqa: PLW1509

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, self.log()
            try:
                if httpx.get(self.url + "/-/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, self.log()
            time.sleep(0.2)

    def query(self, expr: str) -> list[dict[str, Any]]:
        r = httpx.get(self.url + "/api/v1/query", params={"query": expr}, timeout=30)
        assert r.status_code == 200, f"{expr}: {r.text}"
        return r.json()["data"]["result"]

    def query_range(self, expr: str, start: float) -> list[dict[str, Any]]:
        r = httpx.get(self.url + "/api/v1/query_range", timeout=30, params={
            "query": expr, "start": start, "end": time.time(), "step": 1})
        assert r.status_code == 200, f"{expr}: {r.text}"
        return r.json()["data"]["result"]

    def api(self, path: str) -> Any:
        r = httpx.get(self.url + path, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()["data"]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture(scope="module")
def prometheus(obs_cluster: PDCluster, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[Prometheus]:
    prom = Prometheus(tmp_path_factory.mktemp("prometheus"), obs_cluster)
    try:
        prom.wait_ready()
        yield prom
    finally:
        prom.stop()


def has_data(result: list[dict[str, Any]]) -> bool:
    return any(math.isfinite(float(r["value"][1])) for r in result)


@needs_prometheus
def test_every_panel_query_returns_data_after_a_short_load(
        obs_cluster: PDCluster, prometheus: Prometheus) -> None:
    c = obs_cluster
    queries = dashboard_queries()
    exported = exported_families([*(s.url for s in c.prefills + c.decodes), c.url])
    unknown = {k: sorted(metric_names(q) - exported) for k, q in queries.items()
               if metric_names(q) - exported}
    assert not unknown, f"queries name metrics nobody exports: {unknown}"

    deadline = time.monotonic() + DATA_TIMEOUT_S
    while {t["health"] for t in prometheus.api("/api/v1/targets")["activeTargets"]} != {"up"}:
        assert time.monotonic() < deadline, prometheus.api("/api/v1/targets")
        time.sleep(0.5)
    started = time.time()
    send_load(c, 12)
    last_load = time.monotonic()
    pending = dict(queries)
    while pending:  # rates need two scrapes after the load: poll, bounded
        for key, expr in list(pending.items()):
            if has_data(prometheus.query(expr)):
                del pending[key]
        if pending and time.monotonic() - last_load > RELOAD_EVERY_S:
            # a series born in the load has its first sample already counted, and an increase
            # between two scrapes leaves a rate window after a minute: on a busy host either
            # leaves a rate of 0 (NaN quantile). More load, so a slow poll never outlives it.
            send_load(c, 4)
            last_load = time.monotonic()
        if pending and time.monotonic() > deadline:
            detail = {k: prometheus.query(q) for k, q in pending.items()}
            raise AssertionError(f"no data for {sorted(pending)} after the load: {detail}")
        time.sleep(1)
    if os.environ.get("PDSERVE_SCREENSHOT_DIR"):  # by hand: a few more rounds, then a picture
        for _ in range(4):
            time.sleep(3)
            send_load(c, 12)
        time.sleep(3)
        plot_panels(Path(os.environ["PDSERVE_SCREENSHOT_DIR"]) / "grafana-panels.png",
                    dashboard_panels(), lambda e: prometheus.query_range(e, started))


@needs_prometheus
def test_prometheus_evaluates_every_alert_rule_without_error(prometheus: Prometheus) -> None:
    deadline = time.monotonic() + DATA_TIMEOUT_S
    while True:
        rules = [r for g in prometheus.api("/api/v1/rules")["groups"] for r in g["rules"]]
        assert rules, "Prometheus loaded no rule from " + str(RULES)
        # a rule not evaluated yet reports health "unknown"
        if all(r["health"] == "ok" for r in rules):
            return
        bad = [r for r in rules if r["health"] == "err"]
        assert not bad, bad
        assert time.monotonic() < deadline, rules
        time.sleep(0.5)


@needs_prometheus
def test_promtool_checks_the_rules_and_runs_their_unit_tests() -> None:
    check = subprocess.run([str(PROMTOOL), "check", "rules", str(RULES)], check=False,
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    unit = subprocess.run([str(PROMTOOL), "test", "rules", RULES_TEST.name], check=False,
                          capture_output=True, text=True, timeout=60, cwd=RULES_TEST.parent)
    assert unit.returncode == 0, unit.stdout + unit.stderr


def test_dashboard_is_importable_grafana_json() -> None:
    board = json.loads(DASHBOARD.read_text())
    assert board["title"] and board["uid"] and board["schemaVersion"] >= 36
    # a datasource variable (not __inputs) works both imported and provisioned from a file
    [ds] = [v for v in board["templating"]["list"] if v["type"] == "datasource"]
    assert ds["query"] == "prometheus"
    ids = [p["id"] for p in panels(board)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels(board):
        assert {"x", "y", "w", "h"} <= set(panel["gridPos"]), panel["title"]
        if panel["type"] != "row":
            assert panel["targets"] and panel.get("description"), panel["title"]
            assert panel["datasource"]["uid"] == "${" + ds["name"] + "}", panel["title"]
