"""checkov (a security scanner for IaC) passes on what every overlay renders, and every check
it skips is skipped in the manifest with a reason (`checkov.io/skipN: CHECK=reason`
annotations, which survive rendering, unlike YAML comments).

checkov pins old versions of packages the core needs (packaging, networkx), so it is not in the
core's test extra: scripts/test.sh installs it in an environment of its own (pdcore's
`checkov` extra) and runs this file there (it needs no pdcore import); elsewhere it runs where `checkov` is on PATH or in
$PDSERVE_CHECKOV, and skips saying so otherwise. checkov does not know the LeaderWorkerSet CRD:
it scans that overlay's other objects (the LWS pod templates share the base's security
settings, test_manifests.py checks them against the core schemas)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
OVERLAYS = sorted(p.name for p in (ROOT / "overlays").iterdir() if p.is_dir())


def checkov_bin() -> str:
    found = os.environ.get("PDSERVE_CHECKOV") or shutil.which("checkov")
    if not found:
        pytest.skip("checkov is not installed here (pip install checkov; scripts/test.sh runs "
                    "this file in an environment of its own)")
    return found


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> Path:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not on PATH (its built-in kustomize renders the manifests)")
    out = tmp_path_factory.mktemp("rendered")
    for overlay in OVERLAYS:
        r = subprocess.run([kubectl, "kustomize", str(ROOT / "overlays" / overlay)],
                           capture_output=True, text=True, timeout=120, check=False)
        assert r.returncode == 0, r.stderr
        (out / f"{overlay}.yaml").write_text(r.stdout)
    return out


def test_checkov_passes_every_overlay(rendered: Path) -> None:
    exe = checkov_bin()
    # --skip-download: no network here (checkov otherwise fetches guideline links)
    r = subprocess.run([exe, "--directory", str(rendered), "--framework", "kubernetes",
                        "--skip-download", "--output", "json"],
                       capture_output=True, text=True, timeout=600, check=False,
                       env={**os.environ, "BC_SKIP_MAPPING": "TRUE"})
    assert r.stdout.strip(), r.stderr[-3000:]
    report = json.loads(r.stdout)
    reports = report if isinstance(report, list) else [report]
    failed = [(c["check_id"], c["resource"], c["file_path"])
              for rep in reports for c in rep.get("results", {}).get("failed_checks", [])]
    assert not failed, failed
    skipped = [c for rep in reports for c in rep.get("results", {}).get("skipped_checks", [])]
    assert sum(rep["summary"]["parsing_errors"] for rep in reports) == 0
    # it did scan every overlay's workloads (5 overlays: 250+ checks each)
    assert sum(rep["summary"]["passed"] for rep in reports) > 1000
    for c in skipped:
        reason = (c.get("check_result") or {}).get("suppress_comment", "")
        assert len(reason) > 20, (c["check_id"], c["resource"], reason)
    # only the skips the manifests justify: digest pinning, the router's token, RDMA's IPC_LOCK
    assert {c["check_id"] for c in skipped} <= {"CKV_K8S_43", "CKV_K8S_38", "CKV_K8S_25"}


def test_checkov_passes_the_dockerfile() -> None:
    exe = checkov_bin()
    dockerfile = ROOT.parent / "Dockerfile"
    r = subprocess.run([exe, "--file", str(dockerfile), "--framework", "dockerfile",
                        "--skip-download", "--output", "json"],
                       capture_output=True, text=True, timeout=300, check=False,
                       env={**os.environ, "BC_SKIP_MAPPING": "TRUE"})
    assert r.stdout.strip(), r.stderr[-3000:]
    report = json.loads(r.stdout)
    (rep,) = report if isinstance(report, list) else [report]
    assert rep["summary"]["failed"] == 0, rep["results"]["failed_checks"]
    assert rep["summary"]["passed"] > 20 and rep["summary"]["skipped"] == 0
