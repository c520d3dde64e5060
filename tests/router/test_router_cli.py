"""`python -m pdcore.router` argument parsing and a real start in a subprocess."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import typer
from typer.testing import CliRunner

from pdcore.errors import ConfigError
from pdcore.router.cli import build_router_command, parse_router_args

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pdcore.router", *args], check=False, capture_output=True,
                          text=True, timeout=60, env=ENV, cwd=ROOT)


def test_parse_prefill_with_and_without_bootstrap_port():
    cfg = parse_router_args([
        "--pd-disaggregation", "--prefill", "http://127.0.0.1:30000", "8998",
        "--prefill", "http://[::1]:30002/", "none", "--prefill=http://h3:30003",
        "--prefill", "http://h4:30004", "--decode", "http://127.0.0.1:30001",
        "--policy", "round_robin", "--decode-policy=power_of_two", "--port", "8100",
        "--disable-circuit-breaker", "--retry-max-retries", "2", "--health-check-interval-secs=0.5",
    ])
    assert cfg.prefill == [("http://127.0.0.1:30000", 8998), ("http://[::1]:30002", None),
                           ("http://h3:30003", None), ("http://h4:30004", None)]
    assert cfg.decode == ["http://127.0.0.1:30001"]
    assert cfg.effective_prefill_policy == "round_robin"
    assert cfg.effective_decode_policy == "power_of_two"
    assert cfg.port == 8100 and cfg.disable_circuit_breaker and cfg.retry_max_retries == 2
    assert cfg.health_check_interval_secs == 0.5 and cfg.host == "127.0.0.1"
    assert parse_router_args(["--prefill", "http://a:1", "--decode", "http://b:2"]).policy == "cache_aware"


@pytest.mark.parametrize("argv, fragment", [
    (["--prefill", "http://a:1", "--decode"], "--decode needs a worker URL"),
    (["--prefill", "--decode", "http://b:2"], "--prefill needs a worker URL"),
    (["--prefill", "http://a:1", "x99", "--decode", "http://b:2"], "bootstrap port"),
    (["--prefill", "http://a:1", "70000", "--decode", "http://b:2"], "1..65535"),
    (["--prefill", "http://a:1"], "at least one decode"),
    (["--decode", "http://b:2"], "at least one prefill"),
    (["--prefill", "http://a:1", "--decode", "b:2"], "scheme"),
    (["--prefill", "http://a:1", "--decode", "http://b:2", "--port", "x"], "--port expects an integer"),
    (["--prefill", "http://a:1", "--decode", "http://b:2", "--policy", "fastest"], "--policy must be"),
    (["--prefill", "http://a:1", "--decode", "http://b:2", "--polcy", "random"], "did you mean --policy"),
    (["--prefill", "http://a:1", "--decode", "http://b:2", "http://c:3"], "unexpected argument"),
    (["--prefill", "http://a:1", "--decode", "http://a:1"], "given twice"),
])
def test_parse_errors_say_what_to_fix(argv, fragment):
    with pytest.raises(ConfigError, match=None) as info:
        parse_router_args(argv)
    assert fragment in str(info.value)


def test_build_router_command_on_a_typer_app():
    app = typer.Typer()
    build_router_command(app)

    @app.command("other")
    def other() -> None:  # a second command makes "router" a subcommand, as in `pdserve`
        pass

    runner = CliRunner()
    result = runner.invoke(app, ["router", "--prefill", "http://a:1", "8998"])
    assert result.exit_code == 2 and "at least one decode" in result.output
    result = runner.invoke(app, ["router", "--help"])
    assert result.exit_code == 0 and "--prefill URL [BOOTSTRAP_PORT|none]" in result.output


def test_module_cli_bad_input_exits_2():
    proc = _run("--decode")
    assert proc.returncode == 2
    assert "--decode needs a worker URL" in proc.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_module_cli_starts_and_serves(fake_worker):
    p, d = fake_worker("prefill"), fake_worker("decode")
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdcore.router", "--pd-disaggregation", "--prefill", p.url, "8998",
         "--decode", d.url, "--host", "127.0.0.1", "--port", str(port), "--policy", "random",
         "--log-level", "warning"],
        env=ENV, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "router did not become healthy"
            time.sleep(0.1)
        resp = httpx.post(url + "/generate", json={"text": "hi"}, timeout=10)
        assert resp.status_code == 200 and resp.json()["worker"] == d.name
        assert p.wait_received(1)[0]["bootstrap_port"] == 8998
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
