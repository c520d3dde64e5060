"""torch-npu installed on a machine without CANN: the report quotes its real import error.

torch-npu must never be installed into the environment the other tests use (once installed,
plain `import torch` fails where CANN is missing). This test uses a separate folder instead:

    pip install --no-deps --target /tmp/npu-site torch-npu==2.13.0
    PD_ASCEND_TORCH_NPU_SITE=/tmp/npu-site python -m pytest plugins/pd-ascend/tests

and runs pdserve with that folder on PYTHONPATH only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ascend_helpers import clean_env

SITE = os.environ.get("PD_ASCEND_TORCH_NPU_SITE", "")
pytestmark = pytest.mark.skipif(
    not SITE or not (Path(SITE) / "torch_npu").is_dir(),
    reason="set PD_ASCEND_TORCH_NPU_SITE to a folder made by `pip install --no-deps --target "
           "DIR torch-npu==2.13.0` to check how a torch-npu without CANN is reported")

PROBE = ("import json; from pdcore.plugins.host import platforms; "
         "print(json.dumps(platforms().get('npu').available()))")


def _run(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    path = os.pathsep.join(p for p in (SITE, os.environ.get("PYTHONPATH", "")) if p)
    return subprocess.run(list(args), check=False, capture_output=True, text=True, timeout=180,
                          env=clean_env(PYTHONPATH=path, PDCORE_PLUGINS="ascend", **env))


def test_report_quotes_the_missing_cann_library() -> None:
    out = _run(sys.executable, "-c", PROBE, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    assert out.returncode == 0, out.stderr[-2000:]
    ok, reason = json.loads(out.stdout.strip().splitlines()[-1])
    assert ok is False
    assert reason.startswith("torch_npu is installed but fails to load: ImportError: ")
    assert ".so: cannot open shared object file" in reason  # e.g. libhccl.so
    assert "source /usr/local/Ascend/ascend-toolkit/set_env.sh" in reason


def test_serve_device_npu_exits_2_with_the_import_error() -> None:
    """With TORCH_DEVICE_BACKEND_AUTOLOAD=0 (without it, torch itself refuses to import once
    torch-npu is installed, before any pdserve code can report anything)."""
    out = _run(sys.executable, "-m", "pdcore", "serve", "--device", "npu",
               TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    assert out.returncode == 2, out.stderr[-2000:]
    assert "--device npu is not available here: torch_npu is installed but fails to load" \
        in out.stderr
    assert "cannot open shared object file" in out.stderr
