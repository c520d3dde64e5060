"""Ascend settings, parsed from the environment snapshot the core hands to plugins.

Pure stdlib + pdcore: the plugin's availability probes and the tests use it without any vendor
SDK. Variables (names as on the SGLang PD page, plus memfabric's own):
- ASCEND_MF_STORE_URL: `tcp://<ip>:<port>` of memfabric's config store, the same on every P and D
  server. memfabric's own name MF_CONFIG_STORE_URL is accepted when it is unset.
- ASCEND_MF_TRANSFER_PROTOCOL: sdma (default) | device_rdma (Atlas A2 with RoCE).
- ENABLE_ASCEND_TRANSFER_WITH_MOONCAKE: true -> backend `ascend` runs on Mooncake's Ascend
  transport (pd-mooncake) instead of memfabric.
- ASCEND_NPU_PHY_ID: physical NPU id when a container renumbers devices; -1/unset = the logical id.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from pdcore.errors import ConfigError

STORE_URL_VARS = ("ASCEND_MF_STORE_URL", "MF_CONFIG_STORE_URL")
PROTOCOL_VAR = "ASCEND_MF_TRANSFER_PROTOCOL"
MOONCAKE_VAR = "ENABLE_ASCEND_TRANSFER_WITH_MOONCAKE"
PHY_ID_VAR = "ASCEND_NPU_PHY_ID"
# our protocol name -> memfabric TransDataOpType member
PROTOCOLS = {"sdma": "SDMA", "device_rdma": "DEVICE_RDMA"}
DEFAULT_PROTOCOL = "sdma"
ROLES = {"prefill": "Prefill", "decode": "Decode"}  # memfabric accepts exactly these two

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")
_URL_RE = re.compile(r"^tcp://(?P<host>\[[^\]]*\]|[^:/\[\]]*):(?P<port>[^:/]*)$")
# memfabric reads the driver version from these (its log names them when they are missing)
DRIVER_FILES = (Path("/etc/ascend_install.info"), Path("/usr/local/Ascend/driver/version.info"))


@dataclass(frozen=True, slots=True)
class StoreUrl:
    host: str  # an IP address literal: memfabric does not resolve host names
    port: int

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{self.port}"


def parse_store_url(raw: str | None, var: str = STORE_URL_VARS[0]) -> StoreUrl:
    """`tcp://<ip>:<port>` -> StoreUrl; ConfigError saying what is wrong otherwise."""
    example = f"export {var}=tcp://<ip of the first prefill server>:<free port>"
    if raw is None or not raw.strip():
        raise ConfigError(f"{var} is not set; the ascend backend needs memfabric's config store "
                          f"address, the same on every prefill and decode server: {example}")
    text = raw.strip()
    m = _URL_RE.match(text)
    if m is None:
        raise ConfigError(f"{var}={raw!r} is not of the form tcp://<ip>:<port>; {example}")
    host = m.group("host").strip("[]")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        raise ConfigError(
            f"{var}={raw!r}: {host!r} is not an IP address (memfabric-hybrid does not resolve "
            f"host names); {example}") from None
    port = m.group("port")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{var}={raw!r}: the port must be a number in 1..65535; {example}")
    return StoreUrl(str(ip), int(port))


def store_url_from_env(env: Mapping[str, str]) -> StoreUrl:
    for var in STORE_URL_VARS:
        if (env.get(var) or "").strip():
            return parse_store_url(env[var], var)
    return parse_store_url(None)


def parse_protocol(env: Mapping[str, str]) -> str:
    """ASCEND_MF_TRANSFER_PROTOCOL -> "sdma" | "device_rdma" (default sdma).

    SGLang falls back to sdma with a warning on an unknown value; we refuse it, because a typo
    in `device_rdma` would otherwise silently run the other transport.
    """
    raw = env.get(PROTOCOL_VAR)
    if raw is None or not raw.strip():
        return DEFAULT_PROTOCOL
    value = raw.strip().lower()
    if value not in PROTOCOLS:
        raise ConfigError(f"{PROTOCOL_VAR}={raw!r} is not supported; use sdma (the default) or "
                          f"device_rdma (Atlas A2 with a RoCE fabric), or unset it")
    return value


def parse_bool(env: Mapping[str, str], var: str) -> bool:
    raw = env.get(var)
    value = (raw or "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(f"{var}={raw!r} is not a boolean; use true or false")


def use_mooncake(env: Mapping[str, str]) -> bool:
    return parse_bool(env, MOONCAKE_VAR)


def npu_phy_id(env: Mapping[str, str], logical_id: int) -> int:
    """The physical NPU id: ASCEND_NPU_PHY_ID when set to >= 0, else the logical device id."""
    raw = env.get(PHY_ID_VAR)
    if raw is None or not raw.strip():
        return logical_id
    try:
        value = int(raw.strip())
    except ValueError:
        raise ConfigError(f"{PHY_ID_VAR}={raw!r} must be an integer NPU id (or -1 for the "
                          f"logical device id)") from None
    if value < -1:
        raise ConfigError(f"{PHY_ID_VAR}={raw!r} must be >= 0 (or -1 for the logical device id)")
    return logical_id if value == -1 else value


def mf_role(role: str) -> str:
    """pdserve role -> memfabric role name."""
    if role not in ROLES:
        raise ConfigError(
            f"transfer backend 'ascend' serves PD disaggregation only; the server role is "
            f"{role!r}: start it with --disaggregation-mode prefill or decode")
    return ROLES[role]


def ascend_driver_file() -> Path | None:
    """The first driver version file memfabric looks for that exists, else None."""
    for path in DRIVER_FILES:
        if path.is_file():
            return path
    return None


def session_host(host: str) -> str:
    """The IP address peers reach this engine at (memfabric session ids are `ip:port`)."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        try:
            ip = ipaddress.ip_address(socket.gethostbyname(host)) if host else None
        except (OSError, UnicodeError):
            ip = None
        if ip is None:
            raise ConfigError(f"transfer backend 'ascend': the advertised host {host!r} is neither "
                              f"an IP address nor a resolvable host name; pass --host <ip>"
                              ) from None
    if ip.is_unspecified:
        raise ConfigError(f"transfer backend 'ascend': {host!r} cannot be advertised to peers; "
                          f"pass --host <this server's ip>")
    return str(ip)


@dataclass(frozen=True, slots=True)
class MemfabricSettings:
    store_url: StoreUrl
    protocol: str  # sdma | device_rdma
    role: str  # Prefill | Decode
    device_id: int  # logical NPU id (ctx.gpu_id): memfabric's device_id
    host: str  # address peers reach this engine at (session id host part)
    threads: int  # worker threads issuing blocking batch writes

    @classmethod
    def from_context(cls, ctx: object) -> MemfabricSettings:
        env: Mapping[str, str] = getattr(ctx, "env", None) or {}
        host = session_host(str(getattr(ctx, "host", "") or ""))
        return cls(
            store_url=store_url_from_env(env),
            protocol=parse_protocol(env),
            role=mf_role(str(getattr(ctx, "role", "null"))),
            device_id=int(getattr(ctx, "gpu_id", 0)),
            host=host,
            threads=max(1, int(getattr(ctx, "thread_pool_size", 4))),
        )
