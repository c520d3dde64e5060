"""Configuration parsing and its errors (pure; no vendor SDK), plus a cross-check of the store
URL rules against memfabric-hybrid's own parser."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from ascend_helpers import clean_env, free_port, needs_memfabric
from pd_ascend.settings import (
    MemfabricSettings,
    StoreUrl,
    mf_role,
    npu_phy_id,
    parse_protocol,
    parse_store_url,
    session_host,
    store_url_from_env,
    use_mooncake,
)

from pdcore.errors import ConfigError
from pdcore.interfaces.transfer import BackendContext


@pytest.mark.parametrize("raw, host, port", [
    ("tcp://127.0.0.1:24669", "127.0.0.1", 24669),
    ("  tcp://10.0.0.7:1 ", "10.0.0.7", 1),
    ("tcp://[::1]:65535", "::1", 65535),
])
def test_store_url_accepted(raw: str, host: str, port: int) -> None:
    url = parse_store_url(raw)
    assert (url.host, url.port) == (host, port)
    assert parse_store_url(str(url)) == url  # str() round-trips


@pytest.mark.parametrize("raw, needle", [
    (None, "ASCEND_MF_STORE_URL is not set"),
    ("", "ASCEND_MF_STORE_URL is not set"),
    ("127.0.0.1:24669", "not of the form tcp://<ip>:<port>"),
    ("http://127.0.0.1:24669", "not of the form tcp://<ip>:<port>"),
    ("tcp://127.0.0.1", "not of the form tcp://<ip>:<port>"),
    ("tcp://127.0.0.1:24669/x", "not of the form tcp://<ip>:<port>"),
    ("tcp://localhost:24669", "'localhost' is not an IP address"),
    ("tcp://999.1.1.1:24669", "'999.1.1.1' is not an IP address"),
    ("tcp://127.0.0.1:0", "port must be a number in 1..65535"),
    ("tcp://127.0.0.1:70000", "port must be a number in 1..65535"),
    ("tcp://127.0.0.1:http", "port must be a number in 1..65535"),
])
def test_store_url_refused(raw: str | None, needle: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_store_url(raw)
    assert needle in str(e.value)
    assert "export ASCEND_MF_STORE_URL=tcp://" in str(e.value)  # says what to do


def test_store_url_from_env_prefers_ascend_then_memfabric_name() -> None:
    both = {"ASCEND_MF_STORE_URL": "tcp://127.0.0.1:1000", "MF_CONFIG_STORE_URL": "tcp://127.0.0.1:2"}
    assert store_url_from_env(both) == StoreUrl("127.0.0.1", 1000)
    assert store_url_from_env({"MF_CONFIG_STORE_URL": "tcp://127.0.0.1:2"}).port == 2
    with pytest.raises(ConfigError, match="MF_CONFIG_STORE_URL='nope'"):
        store_url_from_env({"MF_CONFIG_STORE_URL": "nope"})
    with pytest.raises(ConfigError, match="ASCEND_MF_STORE_URL is not set"):
        store_url_from_env({})


@pytest.mark.parametrize("raw, expected", [
    (None, "sdma"), ("", "sdma"), ("sdma", "sdma"), ("SDMA", "sdma"),
    ("device_rdma", "device_rdma"), (" Device_RDMA ", "device_rdma"),
])
def test_protocol(raw: str | None, expected: str) -> None:
    env = {} if raw is None else {"ASCEND_MF_TRANSFER_PROTOCOL": raw}
    assert parse_protocol(env) == expected


@pytest.mark.parametrize("raw", ["rdma", "device-rdma", "host_rdma", "tcp"])
def test_protocol_refused(raw: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_protocol({"ASCEND_MF_TRANSFER_PROTOCOL": raw})
    assert f"ASCEND_MF_TRANSFER_PROTOCOL={raw!r} is not supported" in str(e.value)
    assert "sdma" in str(e.value) and "device_rdma" in str(e.value)


@pytest.mark.parametrize("raw, expected", [
    (None, False), ("", False), ("false", False), ("0", False), ("off", False),
    ("true", True), ("True", True), ("1", True), ("yes", True),
])
def test_mooncake_switch(raw: str | None, expected: bool) -> None:
    env = {} if raw is None else {"ENABLE_ASCEND_TRANSFER_WITH_MOONCAKE": raw}
    assert use_mooncake(env) is expected


def test_mooncake_switch_refuses_garbage() -> None:
    with pytest.raises(ConfigError, match="ENABLE_ASCEND_TRANSFER_WITH_MOONCAKE='maybe' is not a "
                                          "boolean"):
        use_mooncake({"ENABLE_ASCEND_TRANSFER_WITH_MOONCAKE": "maybe"})


@pytest.mark.parametrize("raw, logical, expected", [
    (None, 3, 3), ("", 3, 3), ("-1", 3, 3), ("0", 3, 0), ("7", 2, 7), (" 5 ", 0, 5),
])
def test_npu_phy_id(raw: str | None, logical: int, expected: int) -> None:
    env = {} if raw is None else {"ASCEND_NPU_PHY_ID": raw}
    assert npu_phy_id(env, logical) == expected


@pytest.mark.parametrize("raw, needle", [("x", "must be an integer"), ("-2", "must be >= 0")])
def test_npu_phy_id_refused(raw: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        npu_phy_id({"ASCEND_NPU_PHY_ID": raw}, 0)


def test_roles() -> None:
    assert (mf_role("prefill"), mf_role("decode")) == ("Prefill", "Decode")
    with pytest.raises(ConfigError, match="--disaggregation-mode prefill or decode"):
        mf_role("null")


def test_session_host() -> None:
    assert session_host("127.0.0.1") == "127.0.0.1"
    assert session_host("::1") == "::1"
    assert session_host("localhost") in ("127.0.0.1", "::1")  # names are resolved
    for bad in ("0.0.0.0", "::", ""):
        with pytest.raises(ConfigError, match="pass --host"):
            session_host(bad)
    with pytest.raises(ConfigError, match="neither an IP address nor a resolvable host name"):
        session_host("no-such-host.invalid")


def test_memfabric_settings_from_context() -> None:
    ctx = BackendContext(role="decode", gpu_id=3, host="127.0.0.1", thread_pool_size=6,
                         env={"ASCEND_MF_STORE_URL": "tcp://127.0.0.1:24669",
                              "ASCEND_MF_TRANSFER_PROTOCOL": "device_rdma"})
    s = MemfabricSettings.from_context(ctx)
    assert s == MemfabricSettings(StoreUrl("127.0.0.1", 24669), "device_rdma", "Decode", 3,
                                  "127.0.0.1", 6)


@pytest.mark.parametrize("ctx, needle", [
    (BackendContext(role="prefill"), "ASCEND_MF_STORE_URL is not set"),
    (BackendContext(role="null", env={"ASCEND_MF_STORE_URL": "tcp://127.0.0.1:1"}),
     "serves PD disaggregation only"),
    (BackendContext(role="prefill", env={"ASCEND_MF_STORE_URL": "tcp://127.0.0.1:1",
                                         "ASCEND_MF_TRANSFER_PROTOCOL": "rdma"}),
     "is not supported"),
])
def test_memfabric_settings_errors(ctx: BackendContext, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        MemfabricSettings.from_context(ctx)


AGREEMENT = textwrap.dedent("""
    import json, os, sys
    import memfabric_hybrid as mf
    mf.set_extern_logger(lambda level, msg: None)   # keep stdout for the answer
    print(json.dumps({u: mf.create_config_store(u) for u in sys.argv[1:]}), flush=True)
    os._exit(0)  # skip the store's ~3 s shutdown at exit
""")


@needs_memfabric
def test_url_rules_agree_with_memfabric() -> None:
    """URLs we refuse, memfabric refuses too (so we only fail earlier, with a clearer message),
    and a loopback URL we accept, memfabric accepts."""
    ok = f"tcp://127.0.0.1:{free_port()}"
    refused = ["tcp://localhost:24669", "tcp://127.0.0.1:0", "tcp://127.0.0.1:70000",
               "http://127.0.0.1:24669"]
    out = subprocess.run([sys.executable, "-c", AGREEMENT, ok, *refused], check=False,
                         capture_output=True, text=True, timeout=60, env=clean_env())
    answers = json.loads(out.stdout.strip().splitlines()[-1])
    assert answers[ok] == 0
    parse_store_url(ok)
    for url in refused:
        assert answers[url] != 0, f"memfabric accepted {url}"
        with pytest.raises(ConfigError):
            parse_store_url(url)
