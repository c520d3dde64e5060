"""`pdserve serve` / `python -m pdcore.launch_server` flag handling."""

from __future__ import annotations

import dataclasses
import json
import shutil
import socket
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from pdcore.cli import build_app
from pdcore.config import ServerArgs
from pdcore.server.startup.args_parser import NARGS, build_parser, parse_server_args

runner = CliRunner()


def serve(*argv: str) -> tuple[int, str]:
    result = runner.invoke(build_app(), ["serve", *argv])
    return result.exit_code, result.output + (result.stderr if result.stderr_bytes else "")


def test_every_server_arg_is_a_flag():
    text = build_parser().format_help()
    for name in ServerArgs.field_names():
        assert "--" + name.replace("_", "-") in text, name
    for alias in ("--tp", "--dp", "--model", "--backend"):
        assert alias in text


def test_help_exits_0_and_lists_flags():
    code, out = serve("--help")
    assert code == 0 and "--chunked-prefill-size" in out and "--disaggregation-mode" in out


def test_parse_types_aliases_and_bools(tiny_llama_dir):
    args = parse_server_args(["--model", str(tiny_llama_dir), "--tp", "1", "--dp-size", "1", "--backend",
                              "shm", "--trust-remote-code", "--mem-fraction-static", "0.5",
                              "--context-length", "4096", "--disable-radix-cache",
                              "--disaggregation-mode", "decode", "--port", "1234"])
    assert (args.model_path, args.tp_size, args.dp_size) == (str(tiny_llama_dir), 1, 1)
    assert args.disaggregation_transfer_backend == "shm" and args.trust_remote_code
    assert args.mem_fraction_static == 0.5 and args.context_length == 4096
    assert args.disable_radix_cache and args.disaggregation_mode == "decode"
    assert args.port == 1234
    defaults = parse_server_args([])
    for f in ServerArgs.field_names():
        if f == "quantization":  # read from the checkpoint at parse: the default model's GGUF
            assert defaults.quantization == "gguf"
            continue
        assert getattr(defaults, f) == getattr(ServerArgs(), f), f


@pytest.mark.parametrize("argv,needle", [
    (["--bogus-flag"], "unrecognized arguments: --bogus-flag"),
    (["--port", "abc"], "argument --port: invalid int value: 'abc'"),
    (["--mem-fraction-static", "x"], "--mem-fraction-static"),
    (["--disaggregation-mode", "both"], "invalid choice: 'both'"),
    (["--dp-size", "4", "--nnodes", "2", "--dist-init-addr", "127.0.0.1:5000"],
     "--tp-size 1 must be a multiple of --nnodes 2"),
    (["--dp-size", "2", "--dist-init-addr", "127.0.0.1:5000"], "needs no --dist-init-addr"),
    (["--dp-size", "2", "--load-balance-method", "random"], "invalid choice: 'random'"),
    (["--mem-fraction-static", "1.5"], "--mem-fraction-static must be in (0, 1]"),
    (["--page-size", "0"], "--page-size must be >= 1"),
    (["--port", "70000"], "ports must be in 1..65535"),
    (["--device", "tpu9"], "no platform plugin named 'tpu9'"),
    (["--attention-backend", "ascend"], "--attention-backend ascend needs --device npu"),
    (["--model-pat", "x"], "unrecognized arguments"),  # no abbreviations
    (["--tokenizer-path", "/nonexistent/tok"], "--tokenizer-path /nonexistent/tok does not exist"),
])
def test_bad_flags_exit_2_with_message(argv, needle, capsys):
    # parse only: a flag set that unexpectedly passed must not start a server in the test
    with pytest.raises(SystemExit) as exc:
        parse_server_args(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    assert needle in err, err


def test_unavailable_platform_plugin_exits_2(capsys):
    """A device whose platform plugin is installed but cannot run here names the reason."""
    from pdcore.plugins.host import platforms

    unavailable = [e for e in platforms().entries() if not e.available()[0]]
    if not unavailable:
        pytest.skip("every installed platform is available here")
    entry = unavailable[0]
    with pytest.raises(SystemExit) as exc:
        parse_server_args(["--device", entry.name])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"--device {entry.name} is not available here" in err, err


def test_serve_command_exits_2_on_bad_flag():
    code, out = serve("--no-such-flag")
    assert code == 2 and "unrecognized arguments: --no-such-flag" in out


def test_busy_port_exits_2_before_loading(tiny_llama_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        code, out = serve("--port", str(port), "--model-path", str(tiny_llama_dir))
    assert code == 2 and f"cannot listen on 127.0.0.1:{port}" in out, out


@pytest.mark.parametrize("module", [["-m", "pdcore", "serve"], ["-m", "pdcore.launch_server"]])
def test_real_process_exit_codes(module):
    for argv, needle in ((["--nope"], "unrecognized arguments: --nope"),
                         (["--dp", "2", "--nnodes", "2", "--dist-init-addr", "127.0.0.1:5000"],
                          "must be a multiple of --nnodes")):
        p = subprocess.run([sys.executable, *module, *argv], capture_output=True, text=True,
                           timeout=120, check=False)
        assert p.returncode == 2, p.stderr
        assert needle in p.stderr


HEAVY = ("fastapi", "uvicorn", "transformers", "torch")  # typer itself imports pydantic


@pytest.mark.parametrize("argv", [["--help"], ["serve", "--nope"], ["router", "--nope"],
                                  ["up", "--help"]])
def test_command_line_parsing_imports_no_http_stack(argv):
    """Parsing a command line (a refused flag, --help) imports neither the HTTP stack nor the
    model libraries: `pdserve serve --nope` spent ~0.4 of its ~0.8 CPU-seconds importing
    FastAPI through the router's command before saying what was wrong."""
    code = ("import atexit, sys\n"
            f"atexit.register(lambda: print([m for m in {HEAVY!r} if m in sys.modules]))\n"
            f"sys.argv = ['pdserve', *{argv!r}]\n"
            "from pdcore.cli import main\nmain()")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       check=False)
    assert p.returncode == (0 if "--help" in argv else 2), p.stderr
    assert p.stdout.strip().splitlines()[-1] == "[]", (p.stdout[-500:], p.stderr[-2000:])


def test_missing_model_exits_2(tmp_path):
    code, out = serve("--model-path", str(tmp_path / "missing"))
    assert code == 2 and "does not exist" in out, out


def test_engine_start_failure_exits_1(tiny_llama_dir, tmp_path):
    """A model the scheduler cannot load: the reason reaches the user, exit code 1."""
    bad = tmp_path / "gpt2ish"
    shutil.copytree(tiny_llama_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = subprocess.run([sys.executable, "-m", "pdcore", "serve", "--model-path", str(bad),
                        "--port", str(port)], capture_output=True, text=True, timeout=300,
                       check=False)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "engine failed to start" in p.stderr and "GPT2LMHeadModel" in p.stderr
    assert f"listening on http://127.0.0.1:{port}" in p.stdout


# "int | str": read as text, ServerArgs.validate makes it a number or its word
# (--decode-step-prefill-tokens N | -1 | auto)
PLAIN_TYPES = {"bool", "float", "float | None", "int", "int | None", "str", "str | None",
               "int | str"}


def test_server_args_fields_are_plain():
    # the generated parser relies on simple annotations; a new field type needs support here
    names = {f.name for f in dataclasses.fields(ServerArgs)}
    assert set(ServerArgs.INTERNAL_FIELDS) <= names  # no stale entry hides a renamed flag
    flags = set(ServerArgs.field_names())
    assert flags == names - set(ServerArgs.INTERNAL_FIELDS)
    for f in dataclasses.fields(ServerArgs):
        if f.name in NARGS:  # list flags: the parser's NARGS table says how to read them
            assert f.type.startswith("list["), f"{f.name}: {f.type!r}"
        elif f.name in flags:
            assert f.type in PLAIN_TYPES, f"{f.name}: {f.type!r}"
