"""`pdserve serve` with the seed page's Ascend flags on a machine without an NPU: exit 2 with a
message naming what is missing (the core's args_parser asks the platform plugin)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
from ascend_helpers import clean_env, free_port

from pdcore.plugins.host import platforms

pytestmark = pytest.mark.skipif(
    platforms().get("npu").available()[0],
    reason="an NPU answers here: pdserve serve --device npu would start")
# `python -m pdcore` of this interpreter, not the `pdserve` found on PATH: in CI each plugin has its
# own venv layered on the core's, and the core venv's console script does not see this plugin.
PDSERVE = [sys.executable, "-m", "pdcore"]


def serve(*flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*PDSERVE, "serve", *flags], check=False, capture_output=True,
                          text=True, timeout=120, env=clean_env(ASCEND_MF_STORE_URL="tcp://127.0.0.1:1"))


def _npu_reason() -> str:
    return platforms().get("npu").available()[1]


def test_device_npu_exits_2_naming_what_is_missing() -> None:
    out = serve("--device", "npu", "--port", str(free_port()))
    assert out.returncode == 2
    assert out.stderr.strip() == (f"pdserve serve: error: --device npu is not available here: "
                                  f"{_npu_reason()}")
    if importlib.util.find_spec("torch_npu") is None:
        assert "torch_npu is not installed" in out.stderr


def test_seed_prefill_command_exits_2() -> None:
    """The seed page's prefill flags (minus the model and NPU-only tuning flags)."""
    out = serve("--attention-backend", "ascend", "--device", "npu", "--host", "127.0.0.1",
                "--port", str(free_port()), "--disaggregation-mode", "prefill",
                "--disaggregation-transfer-backend", "ascend",
                "--disaggregation-bootstrap-port", str(free_port()), "--base-gpu-id", "0",
                "--disable-radix-cache", "--chunked-prefill-size", "-1",
                "--max-running-requests", "16", "--mem-fraction-static", "0.8")
    assert out.returncode == 2
    assert "--device npu is not available here" in out.stderr
    assert _npu_reason() in out.stderr


def test_attention_backend_ascend_needs_device_npu() -> None:
    out = serve("--attention-backend", "ascend", "--port", str(free_port()))
    assert out.returncode == 2
    assert "--attention-backend ascend needs --device npu" in out.stderr
