"""NIXL settings parsing without the SDK."""

from __future__ import annotations

import pytest
from pd_nixl.settings import NixlSettings, describe_error, parse_params

from pdcore.errors import ConfigError


def test_defaults() -> None:
    s = NixlSettings.from_env({})
    assert (s.backend, s.params, s.progress, s.pump_interval_s) == ("UCX", {}, "pump", 0.001)


def test_backend_and_params_from_env() -> None:
    s = NixlSettings.from_env({
        "SGLANG_DISAGGREGATION_NIXL_BACKEND": "LIBFABRIC",
        "SGLANG_DISAGGREGATION_NIXL_BACKEND_PARAMS": '{"num_workers": 2, "flag": true, "x": "y"}',
        "PDCORE_NIXL_PROGRESS": "Thread", "PDCORE_NIXL_PUMP_MS": "0.5",
    })
    assert s.backend == "LIBFABRIC"
    assert s.params == {"num_workers": "2", "flag": "true", "x": "y"}
    assert s.progress == "thread" and s.pump_interval_s == 0.0005


@pytest.mark.parametrize("raw, message", [
    ("{bad", "is not valid JSON"),
    ('["a"]', "must be a JSON object"),
    ('{"a": {"b": 1}}', "parameter 'a' must be a string, number or boolean"),
])
def test_bad_params(raw: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_params(raw)


@pytest.mark.parametrize("env, message", [
    ({"PDCORE_NIXL_PROGRESS": "busy"}, "use pump \\(default\\) or thread"),
    ({"PDCORE_NIXL_PUMP_MS": "fast"}, "must be a number of milliseconds"),
    ({"PDCORE_NIXL_PUMP_MS": "0"}, "must be in \\(0, 1000\\]"),
])
def test_bad_progress_settings(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        NixlSettings.from_env(env)


def test_resolve_against_what_nixl_reports() -> None:
    available = ["UCX", "LIBFABRIC", "POSIX"]
    assert NixlSettings.resolve("UCX", available) == "UCX"
    assert NixlSettings.resolve("libfabric", available) == "LIBFABRIC"
    with pytest.raises(ConfigError, match="'MOONCAKE' is not an installed NIXL plugin; NIXL "
                                          "reports these as available: UCX, LIBFABRIC, POSIX"):
        NixlSettings.resolve("MOONCAKE", available)


def test_describe_error_explains_known_codes() -> None:
    class nixlRemoteDisconnectError(Exception):
        pass

    text = describe_error(nixlRemoteDisconnectError("NIXL_ERR_REMOTE_DISCONNECT"))
    assert text.startswith("nixlRemoteDisconnectError: NIXL_ERR_REMOTE_DISCONNECT (the peer "
                           "disconnected")
    assert describe_error(RuntimeError("NIXL_ERR_NOT_FOUND"), data_path=False) == \
        "RuntimeError: NIXL_ERR_NOT_FOUND"
