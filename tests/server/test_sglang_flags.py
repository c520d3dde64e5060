"""SGLang 0.5.23's common server flags (#45 item 12): each is accepted and does what SGLang's
does, or is refused (exit 2) with a message naming why. One real server (tiny random Llama,
loopback) started through --config carries the working ones."""

from __future__ import annotations

import json
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from pdcore.engine.sched.scheduler import room_for_running
from pdcore.errors import ConfigError
from pdcore.router.cli import parse_router_args
from pdcore.server.startup.args_parser import parse_server_args
from pdcore.testing.processes import ServerProcess
from pdcore.testing.tls import make_pki

ROOT = Path(__file__).resolve().parents[2]

# the list: flag -> a value for it (None: a switch)
COMMON: dict[str, str | None] = {
    "--config": "CONFIG", "--tokenizer-mode": "slow", "--skip-tokenizer-init": None,
    "--json-model-override-args": '{"rope_theta": 10000.0}', "--enable-mixed-chunk": None,
    "--stream-interval": "4", "--allow-auto-truncate": None, "--enable-cache-report": None,
    "--preferred-sampling-params": '{"temperature": 0.5}', "--ssl-keyfile": "KEY",
    "--ssl-certfile": "CERT", "--log-requests-level": "2", "--decode-log-interval": "10",
    "--enable-trace": None, "--otlp-traces-endpoint": "127.0.0.1:4318",
    "--crash-dump-folder": "DUMPS", "--show-time-cost": None,
    "--schedule-conservativeness": "1.5", "--enable-torch-compile": None,
}
# refused, and the words their refusal must hold
REFUSED = {"--enable-torch-compile": ("refused", "native C++ kernels", "drop the flag")}


def make_tls_pair(folder: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key (openssl CLI)."""
    key, cert = folder / "key.pem", folder / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True,
                   timeout=60)
    return key, cert


def _value(flag: str, value: str | None, tmp: Path) -> list[str]:
    if value is None:
        return [flag]
    if value == "CONFIG":
        path = tmp / "flags.yaml"
        path.write_text("max-running-requests: 3\n")
        return [flag, str(path)]
    if value in ("KEY", "CERT"):
        key, cert = make_tls_pair(tmp)
        return ["--ssl-keyfile", str(key), "--ssl-certfile", str(cert)]
    if value == "DUMPS":
        return [flag, str(tmp / "dumps")]
    return [flag, value]


@pytest.mark.parametrize("flag", sorted(COMMON))
def test_each_common_flag_is_accepted_or_refused_with_a_reason(flag, tmp_path, capsys):
    argv = _value(flag, COMMON[flag], tmp_path)
    if flag in REFUSED:
        with pytest.raises(SystemExit) as exc:
            parse_server_args(argv)
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert flag in err and all(w in err for w in REFUSED[flag]), err
        return
    if flag == "--enable-trace":
        pytest.importorskip("opentelemetry.sdk", reason="the `trace` extra")
    args = parse_server_args(argv)
    dest = flag[2:].replace("-", "_")
    if flag == "--config":
        assert args.max_running_requests == 3
    elif COMMON[flag] is None:
        assert getattr(args, dest) is True
    elif dest in ("ssl_keyfile", "ssl_certfile"):
        assert args.ssl_keyfile.endswith("key.pem") and args.ssl_certfile.endswith("cert.pem")
    else:
        value = getattr(args, dest)
        given = COMMON[flag]
        want = str(tmp_path / "dumps") if given == "DUMPS" else type(value)(given)
        assert value == want, (value, want)


@pytest.mark.parametrize("argv, words", [
    (["--tokenizer-mode", "fastest"], ["--tokenizer-mode", "auto", "slow"]),
    (["--json-model-override-args", "[1]"], ["--json-model-override-args", "JSON object"]),
    (["--json-model-override-args", "{x"], ["--json-model-override-args", "JSON object"]),
    (["--preferred-sampling-params", '{"temprature": 1}'], ["unknown field", "temprature"]),
    (["--stream-interval", "0"], ["--stream-interval must be >= 1"]),
    (["--log-requests-level", "4"], ["--log-requests-level must be 0, 1, 2 or 3"]),
    (["--schedule-conservativeness", "0"], ["--schedule-conservativeness"]),
    (["--ssl-keyfile", "/nonexistent.pem"], ["--ssl-keyfile and --ssl-certfile"]),
    (["--config"], ["--config needs a file"]),
])
def test_bad_values_exit_2_naming_the_flag(argv, words, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_server_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words), err


def test_config_file_values_yield_to_the_command_line(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text("port: 31999\nlog_requests: true\nstream-interval: 3\n"
                    "preferred-sampling-params: {top_k: 5}\n")
    args = parse_server_args(["--config", str(path), "--stream-interval", "6"])
    assert (args.port, args.log_requests, args.stream_interval) == (31999, True, 6)
    assert json.loads(args.preferred_sampling_params) == {"top_k": 5}
    path.write_text("- a list\n")
    with pytest.raises(SystemExit):
        parse_server_args(["--config", str(path)])
    assert "mapping of flag names" in capsys.readouterr().err
    path.write_text("no-such-flag: 1\n")
    with pytest.raises(SystemExit):
        parse_server_args(["--config", str(path)])
    assert "--no-such-flag" in capsys.readouterr().err


def test_ssl_pair_that_does_not_match_is_refused(tmp_path, capsys):
    key, cert = make_tls_pair(tmp_path)
    with pytest.raises(SystemExit):
        parse_server_args(["--ssl-keyfile", str(cert), "--ssl-certfile", str(cert)])
    assert "not a PEM certificate chain and its private key" in capsys.readouterr().err


def test_router_worker_urls_is_refused_with_the_reason():
    with pytest.raises(ConfigError, match="regular .non-PD. mode.*--prefill URL"):
        parse_router_args(["--worker-urls", "http://127.0.0.1:30000", "http://127.0.0.1:30001"])
    out = subprocess.run([sys.executable, "-m", "pdcore.router", "--worker-urls",
                          "http://127.0.0.1:30000"], capture_output=True, text=True, timeout=60,
                         cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 2 and "--worker-urls" in out.stderr, out.stderr


def test_schedule_conservativeness_keeps_pages_for_running_requests():
    class Blocks:
        num_free = 10

        @staticmethod
        def pages_for(n: int) -> int:
            return -(-n // 4)

    running = [SimpleNamespace(params=SimpleNamespace(max_new_tokens=40), output=[1] * 8)]
    req = SimpleNamespace(remaining=8)  # 2 pages; the running one still needs 8 pages

    def sched(c: float) -> SimpleNamespace:
        return SimpleNamespace(cfg=SimpleNamespace(conservativeness=c), blocks=Blocks,
                               running=running)

    assert room_for_running(sched(1.0), req, 100)  # SGLang's default: admit while pages last
    assert room_for_running(sched(2.0), req, 100)  # 10 - 2 >= 8
    Blocks.num_free = 9
    assert not room_for_running(sched(2.0), req, 100)  # 9 - 2 < 8: wait for the running one
    assert room_for_running(sched(1.5), req, 100)  # half of 8 kept back
    assert room_for_running(SimpleNamespace(cfg=SimpleNamespace(conservativeness=3.0),
                                            blocks=Blocks, running=[]), req, 100)


HTTP: httpx.Client  # verifies the flagged server's certificate against the test's CA


@pytest.fixture(scope="module")
def flagged(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[ServerProcess]:
    global HTTP
    folder = tmp_path_factory.mktemp("flags")
    ca, cert, key = make_pki(folder)
    config = folder / "server.yaml"
    # the working flags, most of them through --config as SGLang users write them
    config.write_text(
        f"model-path: {tiny_llama_dir}\n"
        "json-model-override-args: {max_position_embeddings: 64}\n"
        "allow-auto-truncate: true\n"
        "skip-tokenizer-init: true\n"
        "preferred-sampling-params: {max_new_tokens: 3, ignore_eos: true}\n"
        "log-requests: true\nlog-requests-level: 2\nshow-time-cost: true\n"
        "decode-log-interval: 2\nenable-mixed-chunk: true\nenable-cache-report: true\n"
        "schedule-conservativeness: 1.5\nskip-server-warmup: true\n"
        f"ssl-keyfile: {key}\nssl-certfile: {cert}\n")
    server = ServerProcess("--config", str(config), "--stream-interval", "4",
                           "--max-total-tokens", "512", "--page-size", "4")
    server.url = server.url.replace("http://", "https://")  # --ssl-*: HTTPS only
    HTTP = httpx.Client(verify=ssl.create_default_context(cafile=str(ca)), timeout=60)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert server.alive(), server.log()[-3000:]
            try:
                if HTTP.get(server.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, server.log()[-3000:]
                time.sleep(0.25)
        yield server
    finally:
        HTTP.close()
        server.stop()


def gen(server: ServerProcess, body: dict) -> httpx.Response:
    return HTTP.post(server.url + "/generate", json=body, timeout=60)


def test_https_with_the_given_certificate(flagged):
    assert flagged.url.startswith("https://")
    assert "pdserve ready at https://127.0.0.1" in flagged.log()
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(flagged.url + "/health", timeout=10)  # the system's CAs do not know it
    with pytest.raises(httpx.HTTPError):  # plain HTTP on the HTTPS port: no answer
        httpx.get(flagged.url.replace("https://", "http://") + "/health", timeout=10)


def test_json_model_override_sets_the_context_and_auto_truncate_cuts(flagged):
    models = HTTP.get(flagged.url + "/v1/models").json()
    assert models["data"][0]["max_model_len"] == 64  # max_position_embeddings from the flag
    r = gen(flagged, {"input_ids": list(range(3, 103)),
                      "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 200, r.text  # 100 tokens cut to 63, not refused
    assert r.json()["meta_info"]["prompt_tokens"] == 63
    assert "cut to 63 to fit the context length 64 (--allow-auto-truncate)" in flagged.log()


def test_preferred_sampling_params_fill_what_the_request_leaves_out(flagged):
    r = gen(flagged, {"input_ids": [5, 6, 7], "rid": "pref-1"})
    assert r.status_code == 200, r.text
    assert len(r.json()["output_ids"]) == 3  # max_new_tokens 3 (and ignore_eos) from the flag
    r = gen(flagged, {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 5}})
    assert len(r.json()["output_ids"]) == 5  # the request's own value wins


def test_skip_tokenizer_init_is_ids_in_ids_out(flagged):
    r = gen(flagged, {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}})
    assert r.json()["text"] == "" and len(r.json()["output_ids"]) == 2
    for path, body in (("/generate", {"text": "hello"}),
                       ("/v1/completions", {"prompt": "hello"}),
                       ("/v1/responses", {"input": "hello"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user",
                                                               "content": "hi"}]})):
        r = HTTP.post(flagged.url + path, json=body, timeout=30)
        assert r.status_code == 400, r.text
        assert "--skip-tokenizer-init" in r.json()["error"]["message"]


def test_stream_interval_sends_a_chunk_every_n_tokens(flagged):
    with HTTP.stream("POST", flagged.url + "/generate", timeout=60, json={
            "input_ids": [5, 6, 7], "stream": True,
            "sampling_params": {"max_new_tokens": 13, "ignore_eos": True}}) as r:
        events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    counts = [len(e["output_ids"]) for e in events]
    # the first token at once, then every 4 tokens, then the end: 1, 5, 9, 13
    assert counts == [1, 5, 9, 13], counts


def test_request_log_level_time_cost_and_decode_lines(flagged):
    r = gen(flagged, {"input_ids": [9, 8, 7, 6], "rid": "lvl-2",
                      "sampling_params": {"max_new_tokens": 6, "temperature": 0}})
    assert r.status_code == 200
    log = flagged.log()
    [line] = [ln for ln in log.splitlines() if "request lvl-2:" in ln]
    assert "sampling {" in line and "'temperature': 0.0" in line  # level >= 1
    assert "prompt ids [9, 8, 7, 6]" in line and "output ids [" in line  # level 2
    assert any("time cost lvl-2: first token" in ln for ln in log.splitlines())
    assert "decode batch: " in log and "tokens/s" in log  # every 2 decode steps


def test_host_mem_fraction_is_sized_to_what_the_host_has():
    """#45 item 14: --mem-fraction-static 0.8 on a host only warned, then sized an 18 GiB pool
    on a 24 GiB machine; the pool now takes at most 80% of the memory available."""
    from pdcore.config import ServerArgs
    from pdcore.engine.build import kv_pool_tokens
    from pdcore.interfaces.platform import MemoryInfo

    gib, mib = 1 << 30, 1 << 20
    platform = SimpleNamespace(memory_info=lambda _: MemoryInfo(free_bytes=4 * gib,
                                                                 total_bytes=24 * gib))
    model = SimpleNamespace(parameters=lambda: [])
    args = ServerArgs(mem_fraction_static=0.8)
    tokens = kv_pool_tokens(args, platform, __import__("torch").device("cpu"), model, mib,
                            1 << 20)
    assert tokens == int(0.8 * 4 * gib) // mib  # not 0.8 x 24 GiB
    args = ServerArgs(mem_fraction_static=0.1)  # 2.4 GiB fits the 3.2 GiB share: as asked
    assert kv_pool_tokens(args, platform, __import__("torch").device("cpu"), model, mib,
                          1 << 20) == int(0.1 * 24 * gib) // mib


def test_enable_trace_without_the_sdk_names_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)  # import fails
    with pytest.raises(SystemExit):
        parse_server_args(["--enable-trace"])
    assert "pip install 'pdcore[trace]'" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"pdcore\[trace\]"):
        parse_router_args(["--prefill", "http://a:1", "--decode", "http://b:2",
                           "--enable-trace"])


def test_tokenizer_mode_slow_asks_transformers_for_the_python_tokenizer(tiny_llama_dir,
                                                                       monkeypatch):
    import transformers

    from pdcore.engine.model.tokenizer import load_tokenizer

    calls = []
    real = transformers.AutoTokenizer.from_pretrained

    def spy(path, **kw):  # type: ignore[no-untyped-def]
        calls.append(kw)
        return real(path, **kw)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", spy)
    fast = load_tokenizer(SimpleNamespace(model_path=str(tiny_llama_dir)))
    assert calls == []  # auto: the light loader of tokenizer.json
    slow = load_tokenizer(SimpleNamespace(model_path=str(tiny_llama_dir),
                                          tokenizer_mode="slow"))
    assert [kw.get("use_fast") for kw in calls] == [False]
    # this model ships only tokenizer.json: transformers gives the same tokenizer either way
    assert slow.encode("hello world") == fast.encode("hello world")
