"""Mooncake backend settings, parsed from the BackendContext (flags + environment) in one place.

Pure stdlib + pdcore: the plugin and the tests use it without the SDK installed.

Environment variables read here (from `ctx.env`, the core's snapshot of the environment):
- MOONCAKE_PROTOCOL: rdma (default) | tcp | efa
- MC_FORCE_TCP: Mooncake forces TCP when the variable EXISTS, whatever its value (checked on
  mooncake-transfer-engine 0.3.13: "0", "false" and "" all force TCP); we mirror that.
- MC_FORCE_HCA: Mooncake then refuses to fall back to TCP when no RDMA NIC is usable.
- MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER and MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER (library
  defaults 1024 each): the TCP transport refuses a request beyond queued + pending per peer (then
  often cannot reach that peer again), so their sum bounds our requests in flight per peer, and
  the queue limit bounds one batch call.
- MC_TRANSFER_TIMEOUT (library default 30 s): used to recognise a timed-out batch.
- SGLANG_MOONCAKE_CUSTOM_MEM_POOL, MC_FORCE_MNNVL, MC_INTRANODE_NVLINK: CUDA memory pools.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdcore.errors import ConfigError

log = logging.getLogger("pd_mooncake")

PROTOCOLS = ("rdma", "tcp", "efa")
DEFAULT_QUEUED_PER_PEER = 1024  # mooncake's MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER default
DEFAULT_PENDING_PER_PEER = 1024  # mooncake's MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER default
MAX_SUB_BATCH = 1024  # requests per batch_transfer_async_write call
DEFAULT_TRANSFER_TIMEOUT_S = 30.0

# SGLANG_MOONCAKE_CUSTOM_MEM_POOL value -> our memory-pool name
CUSTOM_POOLS = {
    "NVLINK": "mooncake-nvlink",
    "BAREX": "mooncake-barex",
    "INTRA_NODE_NVLINK": "mooncake-intra-node-nvlink",
}
# the Mooncake variable that makes the engine use the transport each pool is for
POOL_COMPANION_ENV = {"NVLINK": "MC_FORCE_MNNVL", "INTRA_NODE_NVLINK": "MC_INTRANODE_NVLINK"}

_DEVICE_RE = re.compile(r"^[A-Za-z0-9_.:\-]+$")
IB_FLAG = "--disaggregation-ib-device"


def _device_list(value: str, where: str) -> str:
    """Validate a comma-separated device list; returns it normalised ("mlx5_0,mlx5_1")."""
    parts = [p.strip() for p in value.split(",")]
    if not value.strip() or any(not p for p in parts):
        raise ConfigError(
            f"{IB_FLAG}: {where} has an empty device name in {value!r}; "
            f"write a comma-separated list such as 'mlx5_0,mlx5_1'"
        )
    for p in parts:
        if not _DEVICE_RE.match(p):
            raise ConfigError(
                f"{IB_FLAG}: {where} has an invalid device name {p!r} in {value!r}; "
                f"device names look like 'mlx5_0' (letters, digits, '_', '-', '.', ':')"
            )
    return ",".join(parts)


def _device_map(obj: Any, source: str) -> dict[int, str]:
    if not isinstance(obj, dict) or not obj:
        raise ConfigError(
            f"{IB_FLAG}: {source} must be a non-empty JSON object mapping GPU ids to device "
            f'lists, e.g. {{"0": "mlx5_0,mlx5_1", "1": "mlx5_2"}}; got {type(obj).__name__}'
        )
    out: dict[int, str] = {}
    for key, value in obj.items():
        if not isinstance(key, str) or not key.strip().isdigit():
            raise ConfigError(f"{IB_FLAG}: {source}: key {key!r} is not a GPU id (use \"0\", \"1\", ...)")
        if not isinstance(value, str):
            raise ConfigError(
                f"{IB_FLAG}: {source}: the value for GPU {key} must be a string such as "
                f"'mlx5_0,mlx5_1', got {type(value).__name__}"
            )
        out[int(key)] = _device_list(value, f"{source} (GPU {key})")
    return out


def _parse_json(text: str, source: str) -> dict[int, str]:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{IB_FLAG}: {source} is not valid JSON: {e}") from None
    return _device_map(obj, source)


def parse_ib_device(value: str | None, gpu_id: int) -> str:
    """The device list for one GPU from the flag's three forms ("" when the flag is unset).

    1. a comma list shared by every GPU: "mlx5_0" or "mlx5_0,mlx5_1";
    2. a JSON object per GPU id: {"0": "mlx5_0,mlx5_1", "1": "mlx5_2"};
    3. the path of a .json file holding that object.
    """
    if value is None or not value.strip():
        return ""
    text = value.strip()
    if text.startswith("{"):
        mapping = _parse_json(text, "the JSON value")
        source = "the JSON value"
    elif text.lower().endswith(".json") or "/" in text:
        path = Path(text).expanduser()
        try:
            content = path.read_text(encoding="utf-8")
        except OSError as e:
            raise ConfigError(
                f"{IB_FLAG}: cannot read device map file {str(path)!r}: {e.strerror or e}; "
                f"pass an existing readable .json file, a JSON object, or a device list"
            ) from None
        mapping = _parse_json(content, f"file {str(path)!r}")
        source = f"file {str(path)!r}"
    else:
        return _device_list(text, "the device list")
    if gpu_id not in mapping:
        listed = ", ".join(str(k) for k in sorted(mapping))
        raise ConfigError(
            f"{IB_FLAG}: GPU {gpu_id} is missing from the device map in {source} "
            f"(GPUs listed: {listed}); add an entry \"{gpu_id}\": \"<devices>\""
        )
    return mapping[gpu_id]


def parse_custom_pool(env: Mapping[str, str]) -> str | None:
    """SGLANG_MOONCAKE_CUSTOM_MEM_POOL -> "NVLINK" | "BAREX" | "INTRA_NODE_NVLINK" | None."""
    raw = env.get("SGLANG_MOONCAKE_CUSTOM_MEM_POOL")
    if raw is None or not raw.strip():
        return None
    value = raw.strip().upper()
    if value in ("FALSE", "0", "NONE", "OFF"):
        return None
    if value == "TRUE":
        value = "NVLINK"
    if value not in CUSTOM_POOLS:
        raise ConfigError(
            f"SGLANG_MOONCAKE_CUSTOM_MEM_POOL={raw!r} is not supported; use NVLINK (or True), "
            f"BAREX or INTRA_NODE_NVLINK, or unset it"
        )
    return value


def _env_positive_int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{name} must be a positive integer, got {raw!r}") from None
    if value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {raw!r}")
    return value


def _env_seconds(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        return max(float(raw), 5.0)  # mooncake clamps it to at least 5 s
    except ValueError:
        raise ConfigError(f"{name} must be a number of seconds, got {raw!r}") from None


@dataclass(frozen=True, slots=True)
class MooncakeSettings:
    protocol: str  # what initialize() is asked for
    force_tcp: bool  # MC_FORCE_TCP present
    force_hca: bool  # MC_FORCE_HCA present
    device_name: str  # comma list of RDMA devices for this GPU, "" = auto
    custom_pool: str | None  # NVLINK | BAREX | INTRA_NODE_NVLINK | None
    sub_batch: int  # requests per async batch call
    inflight_per_peer: int  # requests in flight to one peer, all threads together
    transfer_timeout_s: float
    thread_pool_size: int
    queue_size: int

    @classmethod
    def from_context(cls, ctx: Any) -> MooncakeSettings:
        env: Mapping[str, str] = ctx.env or {}
        protocol = (env.get("MOONCAKE_PROTOCOL") or "rdma").strip().lower()
        if protocol not in PROTOCOLS:
            raise ConfigError(
                f"MOONCAKE_PROTOCOL={env.get('MOONCAKE_PROTOCOL')!r} is not supported; "
                f"use one of {', '.join(PROTOCOLS)} (rdma is the default)"
            )
        force_tcp = "MC_FORCE_TCP" in env
        if force_tcp and env["MC_FORCE_TCP"].strip().lower() in ("0", "false", "no", "off", ""):
            log.warning(
                "MC_FORCE_TCP=%r is set: Mooncake forces TCP whenever the variable exists, "
                "whatever its value; unset it to allow RDMA", env["MC_FORCE_TCP"],
            )
        if force_tcp:
            protocol = "tcp"
        if protocol == "tcp":
            device_name = ""  # the flag only selects RDMA NICs; ignored over TCP
            if ctx.ib_device:
                log.info("%s is ignored: the Mooncake transport is TCP", IB_FLAG)
        else:
            device_name = parse_ib_device(ctx.ib_device, ctx.gpu_id)
        custom_pool = parse_custom_pool(env)
        if custom_pool in ("NVLINK", "BAREX") and protocol == "efa":
            raise ConfigError(
                f"SGLANG_MOONCAKE_CUSTOM_MEM_POOL={custom_pool} cannot be combined with "
                f"MOONCAKE_PROTOCOL=efa: those pools allocate CUDA VMM memory that the EFA "
                f"provider cannot transfer; unset one of them"
            )
        companion = POOL_COMPANION_ENV.get(custom_pool or "")
        if companion and companion not in env:
            log.warning(
                "SGLANG_MOONCAKE_CUSTOM_MEM_POOL=%s without %s: Mooncake may not pick the "
                "NVLink transport for it; export %s=true as well", custom_pool, companion, companion,
            )
        queued = _env_positive_int(env, "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER",
                                   DEFAULT_QUEUED_PER_PEER)
        pending = _env_positive_int(env, "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER",
                                    DEFAULT_PENDING_PER_PEER)
        # the receiver's queue limit is shared by every engine writing to it: with P TP > D TP
        # all P ranks of a server may write into one D rank at once (each its own engine), so
        # each prefill rank keeps its 1/tp_size share in flight (P TP2 -> D TP1 with the
        # defaults overflowed D's 2048-slot queue). Several prefill servers writing into one
        # decode rank still need a larger MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER on decode.
        share = max(1, int(getattr(ctx, "tp_size", 1) or 1)) if ctx.role == "prefill" else 1
        inflight = max(1, (queued + pending) // share)
        return cls(
            protocol=protocol,
            force_tcp=force_tcp,
            force_hca="MC_FORCE_HCA" in env,
            device_name=device_name,
            custom_pool=custom_pool,
            sub_batch=min(MAX_SUB_BATCH, queued, inflight),
            inflight_per_peer=inflight,
            transfer_timeout_s=_env_seconds(env, "MC_TRANSFER_TIMEOUT", DEFAULT_TRANSFER_TIMEOUT_S),
            thread_pool_size=max(1, int(ctx.thread_pool_size)),
            queue_size=max(1, int(ctx.queue_size)),
        )


def rdma_devices(sysfs: str = "/sys/class/infiniband") -> list[str]:
    """RDMA devices the kernel exposes (what libibverbs enumerates); [] when there are none."""
    try:
        return sorted(p.name for p in Path(sysfs).iterdir())
    except OSError:
        return []


def detect_transport(settings: MooncakeSettings, topology_json: str) -> tuple[str, str | None]:
    """(transport really in use, warning or None) from the engine's local topology.

    Mooncake picks the transport by topology discovery: asked for rdma/efa on a machine
    without an RDMA NIC it silently installs TCP, so we look for HCAs ourselves.
    """
    if settings.protocol == "tcp":
        return "tcp", None
    try:
        topo = json.loads(topology_json) if topology_json.strip() else {}
    except json.JSONDecodeError:
        topo = {}
    hcas: set[str] = set()
    if isinstance(topo, dict):
        for entry in topo.values():
            if isinstance(entry, list):
                for group in entry:
                    if isinstance(group, list):
                        hcas.update(str(h) for h in group)
    if not hcas:
        return "tcp", (
            f"MOONCAKE_PROTOCOL={settings.protocol} but Mooncake found no RDMA device on this "
            f"machine and silently fell back to TCP; set MOONCAKE_PROTOCOL=tcp (or MC_FORCE_TCP=1) "
            f"to make that explicit, or MC_FORCE_HCA=1 to fail instead"
        )
    return settings.protocol, None
