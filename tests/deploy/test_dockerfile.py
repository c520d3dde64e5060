"""deploy/Dockerfile agrees with the rest of the repository (no docker daemon here to build it):
the torch pin is scripts/test.sh's, every plugin it installs exists with the extra it asks for,
what it copies exists, the user is the uid the manifests run as, and it exposes the ports the
manifests use. checkov scans it in test_checkov.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="Python 3.11+ reads pyproject.toml itself")

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "deploy" / "Dockerfile").read_text()


def arg(name: str) -> str:
    m = re.search(rf"^ARG {name}=(.*)$", DOCKERFILE, re.MULTILINE)
    assert m, f"ARG {name} missing"
    return m.group(1).strip().strip('"')


def test_torch_pin_is_the_tested_one() -> None:
    test_sh = (ROOT / "scripts" / "test.sh").read_text()
    (pin,) = re.findall(r"^TORCH_PIN=(\S+)", test_sh, re.MULTILINE)
    assert arg("TORCH_PIN") == pin


def test_plugins_and_extras_exist() -> None:
    for name in arg("PLUGINS").split():
        meta = tomllib.loads((ROOT / "plugins" / name / "pyproject.toml").read_text())
        assert meta["project"]["name"] == name
        if name == "pd-mooncake":
            assert arg("MOONCAKE") in meta["project"]["optional-dependencies"]
    core = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "kubernetes" in core["project"]["optional-dependencies"]  # ".[kubernetes]"
    for src in re.findall(r"^COPY (?!--from)(\S+) ", DOCKERFILE, re.MULTILINE):
        assert (ROOT / src).exists(), src


def test_user_and_ports_match_the_manifests() -> None:
    base = ROOT / "deploy" / "kubernetes" / "base"
    manifests = "".join((base / f).read_text() for f in ("prefill.yaml", "decode.yaml",
                                                         "router.yaml"))
    (user,) = re.findall(r"^USER (\d+):(\d+)$", DOCKERFILE, re.MULTILINE)
    assert set(re.findall(r"runAsUser: (\d+)", manifests)) == {user[0]}
    assert set(re.findall(r"runAsGroup: (\d+)", manifests)) == {user[1]}
    exposed = set(re.search(r"^EXPOSE (.*)$", DOCKERFILE, re.MULTILINE).group(1).split())
    assert set(re.findall(r"containerPort: (\d+)", manifests)) == exposed
    assert re.search(r'^ENTRYPOINT \["pdserve"\]', DOCKERFILE, re.MULTILINE)
