"""Router configuration: one typed dataclass; the CLI flags are generated from its fields."""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field
from functools import cached_property
from urllib.parse import urlsplit

from pdcore.config import admin_api_key, check_keys, cluster_secret
from pdcore.errors import ConfigError
from pdcore.route_auth import route_key

POLICIES = ("random", "round_robin", "power_of_two", "cache_aware")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
WORKER_TYPES = ("prefill", "decode")


def _opt(help_text: str, **extra: object) -> dict[str, object]:
    return {"help": help_text, **extra}


@dataclass
class RouterConfig:
    """Every `pdserve router` flag. Field `foo_bar` is flag `--foo-bar`."""

    pd_disaggregation: bool = field(
        default=False, metadata=_opt("PD mode (the only mode; accepted for sglang-router parity)")
    )
    prefill: list[tuple[str, int | None]] = field(
        default_factory=list,
        metadata=_opt("prefill worker: URL [BOOTSTRAP_PORT|none]; repeatable", special=True),
    )
    decode: list[str] = field(
        default_factory=list, metadata=_opt("decode worker URL; repeatable", special=True)
    )
    host: str = field(default="127.0.0.1", metadata=_opt("address to listen on"))
    port: int = field(default=8000, metadata=_opt("port to listen on"))
    policy: str = field(default="cache_aware", metadata=_opt("policy for both roles", choices=POLICIES))
    prefill_policy: str | None = field(
        default=None, metadata=_opt("policy for prefill (default: --policy)", choices=POLICIES)
    )
    decode_policy: str | None = field(
        default=None, metadata=_opt("policy for decode (default: --policy)", choices=POLICIES)
    )
    # cache_aware tuning (sglang-router names and defaults)
    cache_threshold: float = field(default=0.3, metadata=_opt("min prefix match ratio to follow"))
    balance_abs_threshold: int = field(default=64, metadata=_opt("load gap that means imbalance"))
    balance_rel_threshold: float = field(default=1.5, metadata=_opt("load ratio meaning imbalance"))
    max_tree_size: int = field(default=1 << 24, metadata=_opt("cache_aware chars kept per worker"))
    # data parallel workers (sglang-router's flags)
    dp_aware: bool = field(default=False, metadata=_opt(
        "route to DP ranks: a worker with dp_size N becomes N workers URL@rank, the rank sent "
        "as data_parallel_rank (decode) / disagg_prefill_dp_rank (prefill)"))
    prefill_round_robin_balance: bool = field(default=False, metadata=_opt(
        "pick each prefill server's DP rank round robin and send it to both roles as "
        "disagg_prefill_dp_rank (without it prefill's rank is bootstrap_room % its dp_size)"))
    # power_of_two load source
    load_check_interval_secs: float = field(default=5.0, metadata=_opt("GET /get_load period"))
    # health
    health_check_interval_secs: float = field(default=60.0, metadata=_opt("GET /health period"))
    health_check_timeout_secs: float = field(default=5.0, metadata=_opt("one health check timeout"))
    health_check_endpoint: str = field(default="/health", metadata=_opt("worker health path"))
    health_failure_threshold: int = field(default=3, metadata=_opt("failures -> unhealthy"))
    health_success_threshold: int = field(default=2, metadata=_opt("successes -> healthy"))
    worker_startup_timeout_secs: float = field(
        default=600.0, metadata=_opt("how long to wait for a new worker's first healthy /health")
    )
    # retries
    retry_max_retries: int = field(default=5, metadata=_opt("total attempts per request"))
    retry_initial_backoff_ms: float = field(default=50.0, metadata=_opt("first retry delay"))
    retry_max_backoff_ms: float = field(default=30000.0, metadata=_opt("retry delay cap"))
    retry_backoff_multiplier: float = field(default=1.5, metadata=_opt("retry delay growth"))
    retry_jitter_factor: float = field(default=0.2, metadata=_opt("retry delay jitter (+-)"))
    disable_retries: bool = field(default=False, metadata=_opt("one attempt per request"))
    # request migration (router/migrate.py, docs/faults.md)
    migration_max: int = field(default=3, metadata=_opt(
        "times one stream may move to another decode server when its server dies, freezes or "
        "drains past its timeout mid-stream; 0: never (the stream ends with an error event)"))
    migration_stall_secs: float = field(default=5.0, metadata=_opt(
        "a stream silent this long has its decode server's /health probed; no answer within "
        "--health-check-timeout-secs: the stream moves"))
    # circuit breaker
    cb_failure_threshold: int = field(default=10, metadata=_opt("consecutive failures -> open"))
    cb_success_threshold: int = field(default=3, metadata=_opt("half-open successes -> closed"))
    cb_timeout_duration_secs: float = field(default=60.0, metadata=_opt("open -> half-open after"))
    disable_circuit_breaker: bool = field(default=False, metadata=_opt(
        "never open circuits (worker and pair circuits)"))
    # per-(P, D) pair circuits (router/pairs.py, docs/faults.md): a P-D partition
    pair_cb_failure_threshold: int = field(default=3, metadata=_opt(
        "consecutive peer-fault reports (502 from P or D: the transfer between them failed) on "
        "one prefill-decode pair -> that pair is avoided while another pairing is available"))
    pair_cb_success_threshold: int = field(default=1, metadata=_opt(
        "successful trial requests on a half-open pair -> closed"))
    pair_cb_timeout_duration_secs: float = field(default=30.0, metadata=_opt(
        "an open pair turns half-open after this: one request at a time may try it"))
    disable_pair_circuit_breaker: bool = field(default=False, metadata=_opt(
        "never avoid a prefill-decode pair (worker circuits stay on)"))
    # misc
    mini_lb: bool = field(
        default=False, metadata=_opt("minimal mode: random pairs, no health checks/retries/circuits")
    )
    request_timeout_secs: float = field(default=1800.0, metadata=_opt("whole-request deadline"))
    max_concurrent_requests_per_client: int = field(default=256, metadata=_opt(
        "generate requests one client address may have in flight (more: 429); 0: no limit"))
    prometheus_host: str = field(default="127.0.0.1", metadata=_opt("extra metrics listener host"))
    prometheus_port: int | None = field(
        default=None, metadata=_opt("also serve /metrics on this port (main port always has it)")
    )
    log_level: str = field(default="info", metadata=_opt("log level", choices=LOG_LEVELS))
    api_key: str | None = field(default=None, metadata=_opt(
        "bearer token clients must send on every route but /health (401 otherwise); the router "
        "sends the same key to its workers, so start them with the same --api-key; it never "
        "opens the admin routes"))
    admin_api_key: str | None = field(default=None, metadata=_opt(
        "the admin routes' own bearer token (POST/DELETE /workers, /add_worker, /remove_worker, "
        "/flush_cache); must differ from --api-key; unset: those routes answer 403. The router "
        "sends it on its own admin calls to the workers (cache flush fan-out, trusted prefill "
        "registration), so give the servers the same one (or $PDSERVE_ADMIN_API_KEY, or the "
        "file $PDSERVE_ADMIN_API_KEY_FILE names)"))
    disaggregation_auth_token: str | None = field(default=None, metadata=_opt(
        "the cluster secret (same as the servers'; or $PDSERVE_DISAGGREGATION_AUTH_TOKEN): the "
        "router signs every route it adds with it, so prefill and decode servers accept them; "
        "without it the router registers its prefill workers with its decode workers instead "
        "(POST /disaggregation/trusted_prefill, an admin route: it needs --admin-api-key)"))
    peer_routers: list[str] = field(default_factory=list, metadata=_opt(
        "the other routers over the same workers (pdserve's own flag): admin changes to the "
        "workers are relayed to them, and at start this router takes over the worker list of "
        "the first that answers (pdcore/router/fleet.py): URL ...", special=True))
    peer_sync_interval_secs: float = field(default=5.0, metadata=_opt(
        "with --peer-routers: every this many seconds the router pulls each peer's ledger of "
        "worker changes (signed with the cluster secret) and takes the changes it missed "
        "(pdcore/router/fleet_sync.py); 0: never (relays and the start-up list only)"))
    # Kubernetes service discovery (sglang-router's flags; pdcore/router/discovery.py)
    service_discovery: bool = field(default=False, metadata=_opt(
        "find prefill/decode workers as Ready pods matching --prefill/--decode-selector"))
    selector: dict[str, str] = field(default_factory=dict, metadata=_opt(
        "labels every worker pod carries (added to both role selectors): k=v ...", special=True))
    prefill_selector: dict[str, str] = field(default_factory=dict, metadata=_opt(
        "labels of prefill pods: k=v ...", special=True))
    decode_selector: dict[str, str] = field(default_factory=dict, metadata=_opt(
        "labels of decode pods: k=v ...", special=True))
    service_discovery_port: int = field(default=80, metadata=_opt(
        "worker HTTP port on a discovered pod (a pdserve.ai/port annotation overrides it)"))
    service_discovery_namespace: str | None = field(default=None, metadata=_opt(
        "namespace to watch (default: all namespaces, which needs cluster-wide RBAC)"))
    bootstrap_port_annotation: str = field(default="sglang.ai/bootstrap-port", metadata=_opt(
        "prefill pod annotation holding its bootstrap port"))

    # TLS (sglang-router's flags): HTTPS on the router's port; its calls to workers verify
    # their certificates against these CAs (the system's when none is given)
    tls_cert_path: str | None = field(default=None, metadata=_opt(
        "serve HTTPS with this PEM certificate chain (with --tls-key-path)"))
    tls_key_path: str | None = field(default=None, metadata=_opt(
        "serve HTTPS with this PEM private key (with --tls-cert-path)"))
    ca_cert_paths: list[str] = field(default_factory=list, metadata=_opt(
        "PEM CA file(s) that https:// workers' certificates must chain to (default: the "
        "system's CAs): PATH ...", special=True))
    client_cert_path: str | None = field(default=None, metadata=_opt(
        "PEM client certificate the router shows https:// workers (mTLS)"))
    client_key_path: str | None = field(default=None, metadata=_opt(
        "PEM private key of --client-cert-path"))
    # OpenTelemetry (sglang-router's flags; pdcore/tracing.py)
    enable_trace: bool = field(default=False, metadata=_opt(
        "export a span per request and pass its trace context to the workers (needs the "
        "`trace` extra)"))
    otlp_traces_endpoint: str = field(default="localhost:4318", metadata=_opt(
        "OTLP/HTTP collector HOST:PORT (spans go to http://HOST:PORT/v1/traces) or a URL"))
    worker_urls: list[str] = field(default_factory=list, metadata=_opt(
        "sglang-router's regular (non-PD) mode: refused, this router routes PD pairs only; "
        "give --prefill URL [BOOTSTRAP_PORT] and --decode URL", special=True))

    def upstream_ssl(self) -> ssl.SSLContext | bool:
        """httpx's `verify` for calls to https:// workers: a context trusting
        --ca-cert-paths (with --client-cert-path's pair for mTLS), or True (the system's
        CAs)."""
        if not self.ca_cert_paths and not self.client_cert_path:
            return True
        ctx = ssl.create_default_context()
        try:
            for path in self.ca_cert_paths:
                ctx.load_verify_locations(cafile=path)
            if self.client_cert_path:
                ctx.load_cert_chain(self.client_cert_path, self.client_key_path)
        except (ssl.SSLError, OSError) as e:
            raise ConfigError(f"--ca-cert-paths / --client-cert-path: cannot load ({e})") \
                from None
        return ctx

    @cached_property
    def route_key(self) -> bytes | None:
        """The key that signs routes, from the cluster secret (None: routes go unsigned)."""
        secret = cluster_secret(self.disaggregation_auth_token)
        return route_key(secret) if secret else None

    def worker_headers(self) -> dict[str, str]:
        """Headers on every router -> worker call (health, loads, info, generation)."""
        return {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def admin_headers(self) -> dict[str, str]:
        """Headers on the router's admin calls to its workers (cache flush, trusted prefill
        registration): the admin key, never the API key."""
        return {"authorization": f"Bearer {self.admin_api_key}"} if self.admin_api_key else {}

    @property
    def effective_prefill_policy(self) -> str:
        return "random" if self.mini_lb else (self.prefill_policy or self.policy)

    @property
    def effective_decode_policy(self) -> str:
        return "random" if self.mini_lb else (self.decode_policy or self.policy)

    @property
    def max_attempts(self) -> int:
        return 1 if (self.mini_lb or self.disable_retries) else max(1, self.retry_max_retries)

    @property
    def circuit_breaker_enabled(self) -> bool:
        return not (self.mini_lb or self.disable_circuit_breaker)

    @property
    def pair_circuit_enabled(self) -> bool:
        return self.circuit_breaker_enabled and not self.disable_pair_circuit_breaker

    def role_selectors(self) -> dict[str, dict[str, str]]:
        """--service-discovery: each role's pod labels (the shared --selector included)."""
        return {"prefill": {**self.selector, **self.prefill_selector},
                "decode": {**self.selector, **self.decode_selector}}

    def _validate_discovery(self) -> None:
        if not self.prefill_selector or not self.decode_selector:
            raise ConfigError(
                "--service-discovery needs --prefill-selector K=V ... and --decode-selector K=V "
                "... (the labels of the prefill and of the decode pods)")
        sel = self.role_selectors()
        if sel["prefill"] == sel["decode"]:
            raise ConfigError("--prefill-selector and --decode-selector select the same pods; "
                              "give each role a label of its own (e.g. role=prefill / "
                              "role=decode)")
        check_port(self.service_discovery_port, "--service-discovery-port")
        if not self.bootstrap_port_annotation.strip():
            raise ConfigError("--bootstrap-port-annotation must not be empty")

    def validate(self) -> None:
        """Raise ConfigError naming the flag to fix."""
        _ = self.route_key  # an unreadable cluster-secret file: exit 2 now, not at a request
        self.admin_api_key = admin_api_key(self.admin_api_key)
        check_keys(self.api_key, self.admin_api_key)
        check_tls_and_modes(self)
        if self.max_concurrent_requests_per_client < 0:
            raise ConfigError("--max-concurrent-requests-per-client must be >= 0 (0: no limit)")
        if self.service_discovery:
            self._validate_discovery()
        elif self.selector or self.prefill_selector or self.decode_selector:
            raise ConfigError("the --*-selector flags take effect with --service-discovery only")
        elif not self.prefill:
            raise ConfigError("give at least one prefill worker: --prefill URL [BOOTSTRAP_PORT]")
        elif not self.decode:
            raise ConfigError("give at least one decode worker: --decode URL")
        self.prefill = [(normalize_url(u, "--prefill"), p) for u, p in self.prefill]
        self.decode = [normalize_url(u, "--decode") for u in self.decode]
        self.peer_routers = [normalize_url(u, "--peer-routers") for u in self.peer_routers]
        urls = [u for u, _ in self.prefill] + self.decode
        if self.peer_routers and self.service_discovery:
            raise ConfigError("--peer-routers shares workers given on the command line or added "
                              "at run time; with --service-discovery every router watches the "
                              "same pods already: drop --peer-routers")
        if set(self.peer_routers) & set(urls):
            raise ConfigError("--peer-routers names other routers, not workers: "
                              f"{', '.join(sorted(set(self.peer_routers) & set(urls)))}")
        dup = sorted({u for u in urls if urls.count(u) > 1})
        if dup:
            raise ConfigError(f"worker URL given twice: {', '.join(dup)}; each URL may appear once")
        for _, bport in self.prefill:
            check_port(bport, "--prefill BOOTSTRAP_PORT", allow_none=True)
        check_port(self.port, "--port")
        check_port(self.prometheus_port, "--prometheus-port", allow_none=True)
        for name in ("policy", "prefill_policy", "decode_policy"):
            value = getattr(self, name)
            if value is not None and value not in POLICIES:
                raise ConfigError(
                    f"--{name.replace('_', '-')} must be one of {', '.join(POLICIES)}, got {value!r}"
                )
        if self.log_level.lower() not in LOG_LEVELS:
            raise ConfigError(f"--log-level must be one of {', '.join(LOG_LEVELS)}")
        self.log_level = self.log_level.lower()
        if not self.health_check_endpoint.startswith("/"):
            raise ConfigError("--health-check-endpoint must start with '/'")
        for name in (
            "health_check_interval_secs", "health_check_timeout_secs", "worker_startup_timeout_secs",
            "cb_timeout_duration_secs", "request_timeout_secs", "load_check_interval_secs",
            "retry_backoff_multiplier", "balance_rel_threshold", "migration_stall_secs",
            "pair_cb_timeout_duration_secs",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be > 0")
        for name in (
            "health_failure_threshold", "health_success_threshold", "retry_max_retries",
            "cb_failure_threshold", "cb_success_threshold", "max_tree_size",
            "pair_cb_failure_threshold", "pair_cb_success_threshold",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1")
        if not 0 <= self.peer_sync_interval_secs < float("inf"):
            raise ConfigError("--peer-sync-interval-secs must be >= 0")
        if self.migration_max < 0:
            raise ConfigError("--migration-max must be >= 0")
        if not 0 <= self.cache_threshold <= 1:
            raise ConfigError("--cache-threshold must be in [0, 1]")
        if not 0 <= self.retry_jitter_factor < 1:
            raise ConfigError("--retry-jitter-factor must be in [0, 1)")
        if self.retry_initial_backoff_ms < 0 or self.retry_max_backoff_ms < 0:
            raise ConfigError("--retry-*-backoff-ms must be >= 0")


def normalize_url(url: str, flag: str = "url") -> str:
    """`http(s)://host[:port][/prefix]` without a trailing slash, or ConfigError."""
    url = url.strip().rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(
            f"{flag}: {url!r} is not a worker URL; give it with scheme, e.g. http://127.0.0.1:30000"
        )
    try:
        parts.port  # noqa: B018 - validates the port digits
    except ValueError:
        raise ConfigError(f"{flag}: {url!r} has an invalid port") from None
    if parts.query or parts.fragment:
        raise ConfigError(f"{flag}: {url!r} must not carry a query or fragment")
    return url


def check_port(port: int | None, flag: str, allow_none: bool = False) -> None:
    if port is None and allow_none:
        return
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        raise ConfigError(f"{flag} must be an integer in 1..65535, got {port!r}")


def check_tls_and_modes(config: RouterConfig) -> None:
    """--worker-urls (refused), --enable-trace, the TLS files: ConfigError naming the flag."""
    if config.worker_urls:
        raise ConfigError(
            "--worker-urls is sglang-router's regular (non-PD) mode, which this router does "
            "not serve: it routes prefill/decode pairs only. Give --prefill URL "
            "[BOOTSTRAP_PORT] and --decode URL, or put unified servers behind sglang-router "
            "itself (pdserve serve answers its calls)")
    if config.enable_trace:
        from pdcore.edge.tracing import check_available

        check_available()
    if bool(config.client_cert_path) != bool(config.client_key_path):
        raise ConfigError("mTLS needs both --client-cert-path and --client-key-path")
    from pdcore.edge.ports import tls_settings

    tls_settings(config.tls_cert_path, config.tls_key_path, "--tls-cert-path", "--tls-key-path")
    config.upstream_ssl()
