"""Fail fast and no silent no-ops: what `pdserve serve` knows without the model is checked before
the model loads (exit 2, one line), and a flag or variable that would do nothing warns once."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pdcore.config import ServerArgs
from pdcore.plugins.default_backend import default_transfer_backend
from pdcore.server.startup.args_parser import parse_server_args
from pdcore.testing.processes import free_port

REPO = Path(__file__).resolve().parents[2]


def serve(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`python -m pdcore serve` as a user runs it; a start that got past the checks would load
    the model and keep running, so the timeout itself is a failure."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "pdcore", "serve", "--host", "127.0.0.1",
                           *argv], check=False, capture_output=True, text=True, timeout=120,
                          env=full_env,
                          cwd=REPO)


@pytest.fixture
def busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def _fails_before_loading(r: subprocess.CompletedProcess[str], needle: str) -> None:
    assert r.returncode == 2, r.stderr + r.stdout
    assert needle in r.stderr, r.stderr
    assert "loading the model" not in r.stdout  # nothing was loaded
    errors = [line for line in r.stderr.splitlines() if ": error:" in line]
    assert len(errors) == 1 and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("flags,env,needle", [
    (["--disaggregation-mode", "prefill", "--backend", "nosuch"], {},
     "unknown transfer_backend 'nosuch'"),
    (["--disaggregation-mode", "decode", "--backend", "tcp"],
     {"SGLANG_DISAGGREGATION_QUEUE_SIZE": "abc"},
     "SGLANG_DISAGGREGATION_QUEUE_SIZE must be an integer, got 'abc'"),
    (["--disaggregation-mode", "decode", "--backend", "tcp"],
     {"SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "0"},
     "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL must be > 0"),
    (["--disaggregation-mode", "decode", "--backend", "tcp"],
     {"SGLANG_DISAGG_STAGING_BUFFER": "1", "PDCORE_DISABLE_PLUGINS": "staging"},
     # "unknown ..." where pd-staging is installed but disabled, the install hint where it is not
     "transfer_planner 'staging'"),
    (["--memory-pool", "nosuch"], {}, "unknown memory_pool 'nosuch'"),
    (["--device", "nosuch"], {}, "--device nosuch: no platform plugin"),
    (["--model-path", "/nonexistent/model"], {}, "/nonexistent/model does not exist"),
    (["--tokenizer-worker-num", "2"], {}, "--tokenizer-worker-num 2: only 1 is supported"),
    (["--chat-template", "/nonexistent.jinja"], {}, "--chat-template /nonexistent.jinja: no such"),
    (["--load-format", "gguf"], {}, "--load-format gguf:"),
    (["--kv-cache-dtype", "int4"], {}, "argument --kv-cache-dtype: invalid choice: 'int4'"),
])
def test_fails_fast_with_one_line(tiny_llama_dir, flags, env, needle):
    argv = ["--model-path", str(tiny_llama_dir), "--port", str(free_port()), *flags]
    _fails_before_loading(serve(*argv, env=env), needle)


def test_bad_chat_template_is_refused(tiny_llama_dir, tmp_path):
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}{{ m.content }")
    r = serve("--model-path", str(tiny_llama_dir), "--port", str(free_port()),
              "--chat-template", str(bad))
    _fails_before_loading(r, "is not a valid Jinja template")


def test_busy_ports_fail_fast(tiny_llama_dir, busy_port):
    r = serve("--model-path", str(tiny_llama_dir), "--port", str(busy_port))
    _fails_before_loading(r, f"--port {busy_port}: cannot listen")
    r = serve("--model-path", str(tiny_llama_dir), "--port", str(free_port()),
              "--disaggregation-mode", "prefill", "--backend", "tcp",
              "--disaggregation-bootstrap-port", str(busy_port))
    _fails_before_loading(r, f"--disaggregation-bootstrap-port {busy_port}: cannot listen")
    port = free_port()
    r = serve("--model-path", str(tiny_llama_dir), "--port", str(port), "--disaggregation-mode",
              "prefill", "--backend", "tcp", "--disaggregation-bootstrap-port", str(port))
    _fails_before_loading(r, "is also --port")


def test_unusable_default_model_fails_fast(tmp_path):
    # a folder that is not a model: exit 2 before any import of the weights
    r = serve("--model-path", str(tmp_path), "--port", str(free_port()))
    _fails_before_loading(r, "has neither config.json nor a .gguf file")


def _warnings(capsys: pytest.CaptureFixture[str], argv: list[str],
              monkeypatch: pytest.MonkeyPatch, env: dict[str, str] | None = None) -> list[str]:
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    parse_server_args(argv)
    return [line for line in capsys.readouterr().err.splitlines() if ": warning: " in line]


def test_each_silent_no_op_warns_once(tiny_llama_dir, capsys, monkeypatch):
    argv = ["--model-path", str(tiny_llama_dir), "--port", str(free_port()),
            "--disaggregation-mode", "decode", "--backend", "tcp",
            "--disaggregation-ib-device", "mlx5_0", "--base-gpu-id", "1",
            "--attention-backend", "flashinfer", "--disable-radix-cache",
            "--schedule-policy", "lpm", "--disaggregation-decode-enable-radix-cache"]
    lines = _warnings(capsys, argv, monkeypatch, {"SGLANG_MOONCAKE_CUSTOM_MEM_POOL": "NVLINK"})
    expected = ["--disaggregation-ib-device mlx5_0 is ignored: transfer backend 'tcp'",
                "--base-gpu-id 1 is ignored: platform 'cpu'",
                "SGLANG_MOONCAKE_CUSTOM_MEM_POOL is set but ignored: transfer backend 'tcp'",
                "--attention-backend flashinfer is ignored",
                "--schedule-policy lpm runs as fcfs",
                "--disaggregation-decode-enable-radix-cache is ignored: --disable-radix-cache"]
    for needle in expected:
        assert sum(needle in line for line in lines) == 1, (needle, lines)
    assert len(lines) == len(expected), lines


def test_no_warning_where_the_setting_is_used(tiny_llama_dir, capsys, monkeypatch):
    # unified mode with defaults: nothing to warn about
    assert _warnings(capsys, ["--model-path", str(tiny_llama_dir), "--port",
                              str(free_port())], monkeypatch) == []
    # mooncake declares that it reads the IB device and its memory-pool variable
    pytest.importorskip("pd_mooncake")
    lines = _warnings(capsys, ["--model-path", str(tiny_llama_dir), "--port", str(free_port()),
                               "--disaggregation-mode", "decode", "--backend", "mooncake",
                               "--disaggregation-ib-device", "mlx5_0"], monkeypatch,
                      {"MOONCAKE_PROTOCOL": "tcp"})
    assert lines == []


def test_default_backend_is_mooncake_where_available_else_tcp(tiny_llama_dir, capsys,
                                                              monkeypatch):
    name, why = default_transfer_backend()
    argv = ["--model-path", str(tiny_llama_dir), "--port", str(free_port()),
            "--disaggregation-mode", "decode"]
    args = parse_server_args(argv)
    assert args.disaggregation_transfer_backend == name
    err = capsys.readouterr().err
    assert f"transfer backend {name} (default: {why})" in err and err.count("transfer backend") == 1
    # without the mooncake plugin the same command picks tcp and says why
    r = serve(*argv, "--port", str(free_port()), env={
        "PDCORE_DISABLE_PLUGINS": "mooncake", "SGLANG_DISAGGREGATION_QUEUE_SIZE": "x"})
    assert r.returncode == 2  # the bad queue size stops it before the model loads
    assert "transfer backend tcp (default: the mooncake backend is not installed" in r.stderr
    # unified mode has no backend and says nothing about one
    assert parse_server_args(argv[:4]).disaggregation_transfer_backend is None
    assert "transfer backend" not in capsys.readouterr().err
    assert ServerArgs().disaggregation_transfer_backend is None


def test_watchdog_timeout_parses(tiny_llama_dir):
    # helper flag of the engine watchdog (its behaviour is tested with the engine-death tests)
    args = parse_server_args(["--model-path", str(tiny_llama_dir), "--port", str(free_port()),
                              "--watchdog-timeout", "7.5"])
    assert args.watchdog_timeout == 7.5
    assert ServerArgs().watchdog_timeout == 300.0  # SGLang's default
