"""Settings parsing without the SDK: --disaggregation-ib-device forms, env handling, pools."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from pd_mooncake.settings import (
    MooncakeSettings,
    detect_transport,
    parse_custom_pool,
    parse_ib_device,
)

from pdcore.errors import ConfigError
from pdcore.interfaces.transfer import BackendContext


def settings(env: dict[str, str] | None = None, **ctx: object) -> MooncakeSettings:
    return MooncakeSettings.from_context(BackendContext(env=env or {}, **ctx))  # type: ignore[arg-type]


# -- --disaggregation-ib-device ---------------------------------------------------------------

@pytest.mark.parametrize("value", [None, "", "   "])
def test_ib_device_unset_means_auto(value: str | None) -> None:
    assert parse_ib_device(value, 0) == ""


def test_ib_device_shared_list_applies_to_every_gpu() -> None:
    assert parse_ib_device("mlx5_roce0", 3) == "mlx5_roce0"
    assert parse_ib_device(" mlx5_0 , mlx5_1 ", 0) == "mlx5_0,mlx5_1"
    assert parse_ib_device("mlx5_0,mlx5_1", 7) == "mlx5_0,mlx5_1"


def test_ib_device_inline_json_per_gpu() -> None:
    value = '{"0": "mlx5_0,mlx5_1", "1": "mlx5_2"}'
    assert parse_ib_device(value, 0) == "mlx5_0,mlx5_1"
    assert parse_ib_device(value, 1) == "mlx5_2"


def test_ib_device_json_file(tmp_path: Path) -> None:
    path = tmp_path / "ib.json"
    path.write_text(json.dumps({"0": "mlx5_0", "1": "mlx5_2, mlx5_3"}))
    assert parse_ib_device(str(path), 1) == "mlx5_2,mlx5_3"
    assert parse_ib_device(str(path), 0) == "mlx5_0"


def test_ib_device_gpu_missing_from_map_names_it_and_the_listed_ones() -> None:
    with pytest.raises(ConfigError, match=r'GPU 2 is missing.*GPUs listed: 0, 1.*"2"'):
        parse_ib_device('{"0": "mlx5_0", "1": "mlx5_1"}', 2)


def test_ib_device_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read device map file .*missing.json"):
        parse_ib_device(str(tmp_path / "missing.json"), 0)
    directory = tmp_path / "dir.json"
    directory.mkdir()
    with pytest.raises(ConfigError, match="cannot read device map file"):
        parse_ib_device(str(directory), 0)


def test_ib_device_bad_json(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="the JSON value is not valid JSON"):
        parse_ib_device('{"0": "mlx5_0",}', 0)
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="bad.json.* is not valid JSON"):
        parse_ib_device(str(path), 0)
    path.write_text('["mlx5_0"]')
    with pytest.raises(ConfigError, match="must be a non-empty JSON object"):
        parse_ib_device(str(path), 0)


@pytest.mark.parametrize("value, message", [
    ("mlx5_0,,mlx5_1", "empty device name"),
    ("mlx5_0,", "empty device name"),
    ("mlx5 0", "invalid device name"),
    ('{"0": ["mlx5_0"]}', "must be a string"),
    ('{"gpu0": "mlx5_0"}', "is not a GPU id"),
    ('{"0": "mlx5_0,,x"}', "empty device name"),
])
def test_ib_device_malformed_values(value: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_ib_device(value, 0)


def test_ib_device_used_for_rdma_and_ignored_when_tcp_is_forced() -> None:
    per_gpu = '{"0": "mlx5_0", "1": "mlx5_1"}'
    assert settings(ib_device=per_gpu, gpu_id=1).device_name == "mlx5_1"
    # a malformed or incomplete map does not matter over TCP: the flag is not used at all
    assert settings({"MC_FORCE_TCP": "1"}, ib_device='{"0": "mlx5_0"}', gpu_id=5).device_name == ""
    assert settings({"MOONCAKE_PROTOCOL": "tcp"}, ib_device="{bad").device_name == ""
    with pytest.raises(ConfigError):
        settings(ib_device="{bad")


# -- environment ------------------------------------------------------------------------------

def test_protocol_default_choice_and_error() -> None:
    assert settings().protocol == "rdma"
    assert settings({"MOONCAKE_PROTOCOL": "TCP"}).protocol == "tcp"
    assert settings({"MOONCAKE_PROTOCOL": "efa"}).protocol == "efa"
    with pytest.raises(ConfigError, match="MOONCAKE_PROTOCOL='ib' is not supported; use one of "
                                          "rdma, tcp, efa"):
        settings({"MOONCAKE_PROTOCOL": "ib"})


@pytest.mark.parametrize("value", ["1", "true", "0", "false", ""])
def test_mc_force_tcp_counts_when_present_like_the_library(value: str,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="pd_mooncake")
    s = settings({"MC_FORCE_TCP": value, "MOONCAKE_PROTOCOL": "rdma"})
    assert s.force_tcp and s.protocol == "tcp"
    warned = "forces TCP whenever the variable exists" in caplog.text
    assert warned == (value in ("0", "false", ""))


def test_inflight_bounds_follow_the_library_queue_limits() -> None:
    s = settings()
    assert (s.sub_batch, s.inflight_per_peer) == (1024, 2048)  # queued + pending admissions
    s = settings({"MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "300"})
    assert (s.sub_batch, s.inflight_per_peer) == (300, 1324)
    s = settings({"MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "300",
                  "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": "100"})
    assert (s.sub_batch, s.inflight_per_peer) == (300, 400)
    s = settings({"MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "65535"})
    assert (s.sub_batch, s.inflight_per_peer) == (1024, 66559)
    # every rank of a TP-2 prefill server may write into the same decode rank: half each
    s = settings(role="prefill", tp_size=2)
    assert (s.sub_batch, s.inflight_per_peer) == (1024, 1024)
    s = settings(role="prefill", tp_size=4)
    assert (s.sub_batch, s.inflight_per_peer) == (512, 512)
    s = settings(role="decode", tp_size=4)  # decode ranks only answer
    assert (s.sub_batch, s.inflight_per_peer) == (1024, 2048)
    for name in ("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER"):
        for bad in ("0", "many"):
            with pytest.raises(ConfigError, match=f"{name} must be"):
                settings({name: bad})


def test_thread_pool_and_queue_come_from_the_context() -> None:
    s = settings(thread_pool_size=6, queue_size=2)
    assert (s.thread_pool_size, s.queue_size) == (6, 2)


def test_transfer_timeout_clamped_like_the_library() -> None:
    assert settings().transfer_timeout_s == 30.0
    assert settings({"MC_TRANSFER_TIMEOUT": "2"}).transfer_timeout_s == 5.0
    with pytest.raises(ConfigError, match="MC_TRANSFER_TIMEOUT"):
        settings({"MC_TRANSFER_TIMEOUT": "soon"})


# -- custom memory pools ----------------------------------------------------------------------

@pytest.mark.parametrize("value, kind", [
    ("NVLINK", "NVLINK"), ("True", "NVLINK"), ("true", "NVLINK"), ("barex", "BAREX"),
    ("INTRA_NODE_NVLINK", "INTRA_NODE_NVLINK"), ("false", None), ("", None),
])
def test_custom_pool_values(value: str, kind: str | None) -> None:
    assert parse_custom_pool({"SGLANG_MOONCAKE_CUSTOM_MEM_POOL": value}) == kind


def test_custom_pool_unknown_value_lists_the_supported_ones() -> None:
    with pytest.raises(ConfigError, match=r"NVLINK \(or True\), BAREX or INTRA_NODE_NVLINK"):
        parse_custom_pool({"SGLANG_MOONCAKE_CUSTOM_MEM_POOL": "HBM"})


def test_custom_pool_incompatible_with_efa() -> None:
    with pytest.raises(ConfigError, match="cannot be combined with MOONCAKE_PROTOCOL=efa"):
        settings({"SGLANG_MOONCAKE_CUSTOM_MEM_POOL": "NVLINK", "MOONCAKE_PROTOCOL": "efa"})


def test_custom_pool_without_its_transport_variable_warns(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="pd_mooncake")
    settings({"SGLANG_MOONCAKE_CUSTOM_MEM_POOL": "INTRA_NODE_NVLINK"})
    assert "without MC_INTRANODE_NVLINK" in caplog.text
    caplog.clear()
    settings({"SGLANG_MOONCAKE_CUSTOM_MEM_POOL": "INTRA_NODE_NVLINK", "MC_INTRANODE_NVLINK": "true"})
    assert "without" not in caplog.text


# -- transport detection ----------------------------------------------------------------------

NO_NIC = '{\n\t"cpu:0" : \n\t[\n\t\t[],\n\t\t[]\n\t]\n}\n'  # as printed by mooncake 0.3.13
ONE_NIC = '{"cpu:0": [["mlx5_0"], []], "cuda:0": [["mlx5_0"], ["mlx5_1"]]}'


def test_detect_transport() -> None:
    rdma = settings()
    transport, warning = detect_transport(rdma, NO_NIC)
    assert transport == "tcp" and warning and "silently fell back to TCP" in warning
    assert detect_transport(rdma, ONE_NIC) == ("rdma", None)
    assert detect_transport(rdma, "{}")[0] == "tcp"  # MC_FORCE_TCP empties the topology
    assert detect_transport(settings({"MOONCAKE_PROTOCOL": "tcp"}), ONE_NIC) == ("tcp", None)
