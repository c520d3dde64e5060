"""The one reader (and writer) of the process environment.

Every variable pdserve and its first-party plugins read is declared here once, as a typed field:
its name (the attribute, upper-cased), its default, how a value is parsed and what it means.
`ENV.<name>` reads the variable when asked (never at import: tests and `pdserve up` set
variables per process), so `ENV.pdcore_tp_timeout` is a float and
`ENV.pdserve_http_max_connections` an int; `Env(mapping)` reads the same fields from a given
mapping (what a caller or a test hands in). A bad value raises `EnvError` (a ConfigError: the CLI
exits 2) naming the variable; `check()` reads them all at start-up, so a bad value stops the
process before it serves, not in a request. docs/environment.md is generated from these
declarations (`python -m pdcore.docs_gen`); SGLang's names and defaults are kept where SGLang's
docs have them.

`os.environ` and `getenv` appear in this module only (tests/test_env.py holds it). Writes:
`child_environ()` is the environment for a process we start (this one's plus overrides: how
variables for a child or a vendor SDK are set); `put()` writes into this process's environment,
only for what libraries loaded later here read (OpenMP, oneDNN: runtime_env.py); `environ()` is
a copy of this process's environment for code that takes a mapping (the transfer backends'
`ctx.env`, the plugins' settings).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import Any, Generic, overload

from pdcore.env_parse import (  # noqa: F401 (the parsers are part of this module's interface)
    EnvError, Parser, T, choice, count, flag, integer, lowered, not_zero, number, positive, text,
    verbatim)


# ---- the field ----------------------------------------------------------------------------------
class Var(Generic[T]):
    """One variable: read through an `Env` instance (`ENV.<attribute>`), declared on its class."""

    def __init__(self, default: T, parse: Parser[T], meaning: str, *, shown: str | None = None,
                 keep_blank: bool = False) -> None:
        self.default, self.parse, self.meaning = default, parse, meaning
        self.shown = shown  # the documented default where `default` does not say it
        self.keep_blank = keep_blank  # a value of spaces is a value (secrets), not unset
        self.name = self.attr = self.topic = ""

    def __set_name__(self, owner: type, attr: str) -> None:
        self.attr, self.name, self.topic = attr, attr.upper(), owner.TOPIC  # type: ignore[attr-defined]

    @overload
    def __get__(self, obj: None, owner: type) -> Var[T]: ...
    @overload
    def __get__(self, obj: Env, owner: type) -> T: ...
    def __get__(self, obj: Env | None, owner: type) -> Var[T] | T:
        return self if obj is None else self.read(obj.source)

    def raw(self, source: Mapping[str, str] | None = None) -> str | None:
        """The value as set (None: unset)."""
        return (os.environ if source is None else source).get(self.name)

    def read(self, source: Mapping[str, str] | None = None) -> T:
        raw = self.raw(source)
        if raw is None or raw == "" or (not self.keep_blank and not raw.strip()):
            return self.default
        return self.parse(self.name, raw)

    def is_set(self, source: Mapping[str, str] | None = None) -> bool:
        return self.raw(source) is not None

    @property
    def documented_default(self) -> str:
        if self.shown is not None:
            return self.shown
        if isinstance(self.default, bool):
            return "1" if self.default else "0"
        if self.default is None:
            return "unset"
        return f"{self.default:g}" if isinstance(self.default, float) else str(self.default)


def _as_is(meaning: str, shown: str = "unset", default: str | None = None) -> Var[str | None]:
    """A variable read as text by whoever takes it (a backend's settings, a library)."""
    return Var(default, text, meaning, shown=shown)


def _mib_at_least_zero(name: str, raw: str) -> float:
    try:
        mb = float(raw.strip())
    except ValueError:
        mb = -1.0
    if not mb >= 0:  # also NaN
        raise EnvError(f"{name} must be a number of MiB >= 0 (0 turns the decode K/V view off); "
                       f"got {raw.strip()!r}")
    return mb


def _host_count(name: str, raw: str) -> int:
    raw = raw.strip()
    n = int(raw) if raw.isdigit() else 0
    if n < 1:
        raise EnvError(f"{name} must be a whole number >= 1; got {raw!r}")
    return n


def _seconds_at_least_zero(name: str, raw: str) -> float:
    try:
        s = float(raw.strip())
    except ValueError:
        s = -1.0
    if not 0 <= s < float("inf"):  # also NaN
        raise EnvError(f"{name} must be a number of seconds >= 0; got {raw.strip()!r}")
    return s


def _cpu_isa(name: str, raw: str) -> str:
    """'' (this CPU as it is), 'avx2' or 'avx512'."""
    value = raw.strip().lower()
    if value in ("auto", "native"):
        return ""
    if value not in ("avx2", "avx512"):
        raise EnvError(f"{name}={value!r}: use auto, avx512 or avx2")
    return value


# ---- the declarations, one class per section of docs/environment.md ----------------------------
class Group:
    __slots__ = ()
    TOPIC = ""


class Disagg(Group):
    """SGLang's names and defaults (its PD disaggregation page); config.DisaggEnv checks ranges."""
    __slots__ = ()
    TOPIC = "PD disaggregation (SGLang's names)"
    sglang_disaggregation_bootstrap_timeout = Var(
        300.0, number, "P waits this many seconds for D's destination pages")
    sglang_disaggregation_waiting_timeout = Var(
        300.0, number, "D waits this many seconds for the KV (Transferring included)")
    pdserve_disaggregation_claim_timeout = Var(
        5.0, number, "P fails a room no decode server claimed within this many seconds (D "
        "claims on admission; a refused route never claims); D frees a room P did not confirm "
        "within 6 times it (D reserves pages only after P confirmed)")
    sglang_disaggregation_heartbeat_interval = Var(
        5.0, number, "seconds between D's checks of each P's bootstrap `/health`", shown="5.0")
    sglang_disaggregation_heartbeat_max_failure = Var(
        2, integer, "failed heartbeats before P is declared lost")
    sglang_disaggregation_thread_pool_size: Var[int | None] = Var(
        None, integer, "transfer threads per rank",
        shown="min(max(4, int(0.75 x cpus) // 8), 12)")
    sglang_disaggregation_queue_size = Var(
        4, integer, "transfer queues, sharded by decode session")
    sglang_disaggregation_bootstrap_entry_cleanup_interval = Var(
        120.0, number, "seconds after which stale bootstrap entries are dropped")
    sglang_disagg_staging_buffer = Var(
        False, flag, "a staging buffer for P and D at different TP sizes (pd-staging)",
        shown="False")
    sglang_disagg_staging_buffer_size_mb = Var(
        64, integer, "the staging buffer's size (pd-staging)")
    sglang_disagg_staging_pool_size_mb = Var(
        4096, integer, "the staging pool's size (pd-staging)")
    disaggregation_test_failure_prob = Var(
        0.0, number, "fail this fraction of rooms on purpose (fault tests)")


class Secrets(Group):
    __slots__ = ()
    TOPIC = "Secrets and trust"
    pdserve_disaggregation_auth_token: Var[str | None] = Var(
        None, verbatim, "the cluster secret (`--disaggregation-auth-token`; docs/security.md)",
        keep_blank=True)
    pdserve_disaggregation_trust_local_prefill: Var[bool | None] = Var(
        None, not_zero, "whether a server trusts unsigned loopback routes to the bootstrap ports "
        "this user's live prefill servers on this host announced: by default yes without a "
        "cluster secret (the seed commands behind sglang-router) and no with one (every route "
        "signed); `0` or `1` decides for both", shown="1 without a cluster secret, 0 with one")
    pdserve_disaggregation_notify_refused = Var(
        True, not_zero, "`0`: a decode server that refuses an unsigned route no longer tells "
        "the prefill server it names (`POST /refused` on its bootstrap port; that room then "
        "ends at the claim timeout)")
    pdserve_disaggregation_auth_token_file = _as_is(
        "a file holding the cluster secret (Kubernetes mounts it so)")
    pdserve_admin_api_key: Var[str | None] = Var(
        None, verbatim, "the admin key (`--admin-api-key`): the only key of the admin routes, "
        "which are off without it (docs/security.md)", keep_blank=True)
    pdserve_admin_api_key_file = _as_is("a file holding the admin key (Kubernetes mounts it so)")


class Backends(Group):
    """Read by the transfer backends and plugins from the mapping they are handed
    (`environ()`), each parsed by its own settings."""
    __slots__ = ()
    TOPIC = "Transfer backends and plugins"
    pdcore_plugins = _as_is("plugins to load (comma-separated names)", "all")
    pdcore_disable_plugins = _as_is("plugins not to load", "none")
    pdcore_tcp_timeout = _as_is("tcp backend: seconds a transfer may wait on its peer", "30")
    pdcore_shm_mode = _as_is("shm backend: `auto`, `cma` or `segment` (same on every server)",
                             "auto")
    pdcore_shm_copy = _as_is("shm segment mode's copy: `vm` or `memmove`", "vm")
    pdcore_shm_timeout = _as_is("shm backend: seconds per batch", "30")
    pdcore_host_id = _as_is("who shares /dev/shm with this process (tests fake other hosts "
                            "with it)", "hostname + boot id")
    mooncake_protocol = _as_is("pd-mooncake: `rdma`, `tcp` or `efa`", "rdma")
    mc_force_tcp = _as_is("pd-mooncake: TCP whenever the variable exists")
    mc_force_hca = _as_is("pd-mooncake: no TCP fallback without an RDMA NIC")
    mc_tcp_max_queued_transfers_per_peer = _as_is(
        "pd-mooncake: queued transfers per peer (bounds a batch)", "1024")
    mc_tcp_max_pending_admissions_per_peer = _as_is(
        "pd-mooncake: pending admissions per peer", "1024")
    mc_transfer_timeout = _as_is("pd-mooncake: seconds before a batch counts as timed out", "30")
    sglang_mooncake_custom_mem_pool = _as_is(
        "pd-mooncake: a CUDA memory pool (`NVLINK`, `BAREX`, `INTRA_NODE_NVLINK`)")
    mc_force_mnnvl = _as_is("pd-mooncake: the NVLink pool's companion switch")
    mc_intranode_nvlink = _as_is("pd-mooncake: the intra-node NVLink pool's switch")
    sglang_disaggregation_nixl_backend = _as_is("pd-nixl: NIXL's transport plugin", "UCX")
    sglang_disaggregation_nixl_backend_params = _as_is(
        "pd-nixl: the plugin's parameters (a JSON object)", "{}")
    pdcore_nixl_progress = _as_is("pd-nixl: `pump` (a pdserve thread polls) or `thread` "
                                  "(NIXL's own, a whole core)", "pump")
    pdcore_nixl_pump_ms = _as_is("pd-nixl: the pump's period", "1")
    nixl_plugin_dir = _as_is("pd-nixl: where NIXL finds its plugins", "the wheel's")
    ascend_mf_store_url = _as_is("pd-ascend: the memfabric store")
    ascend_mf_transfer_protocol = _as_is("pd-ascend: the memfabric protocol")
    enable_ascend_transfer_with_mooncake = _as_is(
        "pd-ascend: move KV with Mooncake's Ascend build", "false")
    ascend_npu_phy_id = _as_is("pd-ascend: the physical NPU id where a container renumbers "
                               "devices", "the logical id")
    ascend_rt_visible_devices = _as_is("pd-ascend: the NPUs this process sees (CANN's)", "all")


class Engine(Group):
    __slots__ = ()
    TOPIC = "Engine and CPU"
    pdcore_cpu_packed_gemm = Var(
        True, flag, "linear layers on packed weights, which replace the originals: panels for "
        "the native GEMMs (float32 on AVX-512 or AVX2, bf16 on AVX-512 BF16) or oneDNN-"
        "reordered (AMX tiles for bf16 where the CPU has AMX)")
    pdcore_gemm_layout = Var(
        "auto", choice("auto", "panels", "onednn"),
        "which packed layout: `auto` times both on each weight shape at load (decode-sized rows "
        "weighted 16:1 against a 256-row prefill chunk) and keeps the faster; `panels` or "
        "`onednn` fix it (/metrics: `pdserve_scheduler_gemm_weights_*`)")
    pdcore_cpu_isa = Var("", _cpu_isa, "run as a CPU with less than this one: `avx2` (no "
        "AVX-512, no bf16 hardware: AMD Zen 2) or `avx512` (AVX-512 with BF16, no AMX: AMD Zen "
        "4); torch's kernels, oneDNN's and the `--dtype bfloat16` check follow it", shown="auto")
    pdcore_cpuinfo = Var("/proc/cpuinfo", text, "the CPU description to read (tests)")
    pdcore_native = Var(
        True, flag, "the engine's native kernels (panel GEMMs, decode attention, decode layer "
        "loop), compiled once per machine and ISA with g++; 0 runs without them")
    pdcore_native_isa = Var(
        "auto", choice("auto", "off", "avx512", "avx2", listing="auto, avx512, avx2 or off"),
        "which native library: `avx512`, `avx2` (an ISA the CPU lacks: none, and the log says "
        "why) or `off`; auto: the best the CPU has; any other value stops the server (exit 2)")
    pdcore_prefill_attention = Var(
        "auto", choice("auto", "native", "sdpa", listing="auto, native or sdpa"),
        "which kernel attends a prefill chunk on the CPU: `native` (engine/native's causal "
        "kernel: a row has the same bits in every phase), `sdpa` (torch's flash attention; its "
        "rows differ in bits from the decode kernel's) or `auto`: SDPA for bf16 chunks of at "
        "least 16 tokens on a CPU with amx_bf16 (PDCORE_CPU_ISA hides it), else native "
        "(docs/cpu.md)")
    pdserve_native_dir: Var[str | None] = Var(None, text, "where the native library is built "
        "(once per machine, under a lock)", shown="~/.cache/pdserve/native")
    pdcore_decode_kv_view_mb = Var(128.0, _mib_at_least_zero, "MiB of decode K/V kept "
                                   "contiguous per request beside the pool; 0 gathers every step")
    pdserve_kv_giveback_idle_s = Var(
        2.0, _seconds_at_least_zero, "a unified server hands its KV pool's free, written pages "
        "back to the kernel once it has been idle this many seconds (docs/cpu.md); 0: at once")
    pdserve_cpu_omp_threads_bind = Var(
        "auto", text, "CPU placement of the engine's OpenMP threads (`--cpu-omp-threads-bind`)")
    pdserve_cpu_team_adapt = Var(True, flag, "shrink the OpenMP team off busy cores (docs/cpu.md)")
    pdserve_http_nice = Var(
        0, count(0, "a nice increment"),
        "once its engine started, the HTTP process (tokenizer, detokenizer, SSE) raises its own "
        "threads' nice by this much (0-19), so it preempts the engine's OpenMP threads less "
        "(docs/cpu.md); the engine keeps the server's nice")
    pdcore_host_servers = Var(
        1, _host_count, "servers sharing this host's KV budget (`pdserve up` sets it)")
    pdcore_tp_timeout = Var(600.0, number, "seconds a TP collective may wait")
    pdcore_gguf_cache = Var(True, flag, "load a .gguf model through a converted copy")
    pdcore_gguf_packed = Var(False, flag, "serve a .gguf model's Q8_0/Q4_0/Q4_1/Q4_K/Q6_K "
                             "weights packed, as the file holds them; 0: de-quantized at load")
    pdcore_gguf_dot = Var("int8", choice("float", "int8", listing="float or int8"), "packed GGUF "
                          "GEMMs: float32 on de-quantized weights, or `int8` x and integer dots")
    pdcore_w8a8_gemm = Var("auto", choice("auto", "amx", "vnni", "avx2",
                                          listing="auto, amx, vnni or avx2"),
                           "the W8A8 int8 GEMM's path at most (A/B runs): `auto` the best the "
                           "CPU and the native library have (AMX-INT8, AVX-512 VNNI, AVX2), "
                           "else the named one, or the best below it the CPU has")
    pdcore_w8a8_lm_head = Var("bf16", choice("float", "bf16", "bf16_dot", "int8",
                                             listing="float, bf16, bf16_dot or int8"),
                              "a W8A8 model's lm_head: `bf16` weights (half the bytes of the "
                              "float one the checkpoint stores; float32 activations), "
                              "`bf16_dot` bf16 weights and activations with AVX-512 BF16 dot "
                              "products (float32 logits; elsewhere `bf16`), `float` as the "
                              "checkpoint stores it, or `int8` per output channel like the "
                              "body (a quarter, less accurate)")
    pdcore_cache_dir: Var[str | None] = Var(
        None, text, "where converted GGUF models are kept", shown="~/.cache/pdserve")
    pdserve_spec_gate = Var(
        True, flag, "speculative decoding verifies drafts only when the measured verify/decode "
        "step cost pays; 0 verifies every draft (identity tests, measurements)")
    pdserve_jump_forward = Var(
        True, flag, "constrained requests draft what their grammar forces next, verified in one "
        "forward pass (TP 1; 0: one token per step)")


class Http(Group):
    __slots__ = ()
    TOPIC = "HTTP and requests"
    pdserve_grammar_compile_timeout_s = Var(
        30.0, number, "a constrained request whose grammar (json_schema, regex, ebnf, a forced "
        "tool call) is still compiling after this many seconds gets 400; compiles run beside "
        "the scheduler, never in its step")
    pdcore_max_request_bytes = Var(
        4 << 20, count(1024, "a byte count"), "largest request body (413 beyond)")
    pdserve_http_header_timeout_s = Var(
        10.0, positive(), "seconds from a connection's first byte to its complete headers")
    pdserve_http_body_timeout_s = Var(
        30.0, positive(), "seconds from a request's headers to its whole body, plus 1 s per "
        "PDSERVE_HTTP_BODY_MIN_RATE bytes received (else 408)")
    pdserve_http_body_min_rate = Var(
        1024.0, positive(), "bytes of body that buy one more second of the body deadline")
    pdserve_http_body_max_s = Var(300.0, positive(), "no request body takes longer than this")
    pdserve_drain_timeout_s = Var(
        30.0, positive(), "seconds a draining server (SIGTERM, POST /drain) waits for its "
        "requests in flight before it aborts them and exits (--drain-timeout wins)")
    pdserve_http_send_timeout_s = Var(
        60.0, positive(), "seconds a client may leave its response unread (writes paused) "
        "before it is closed and its request aborted")
    pdserve_http_max_connections = Var(
        4096, count(1, "a connection count"),
        "open connections per port (at most the descriptor limit less 512)")
    pdserve_http_max_pending_per_peer = Var(
        128, count(1, "a connection count"), "connections one peer (IPv4 address, IPv6 /64, "
        "all of loopback) may hold while they read their request; the next evicts that peer's "
        "slowest")
    pdserve_http_keepalive_s = Var(
        120.0, positive(), "idle keep-alive connections stay this long")


class Libraries(Group):
    """Variables of the libraries pdserve configures: it sets them for the engine (or reads
    whether you did); a value you set wins."""
    __slots__ = ()
    TOPIC = "Set for libraries (a value you set wins)"
    omp_wait_policy = _as_is("OpenMP's; pdserve sets PASSIVE, or removes it where the engine "
                             "owns its cores (runtime_env.py)", "PASSIVE")
    omp_num_threads = _as_is("OpenMP's; set, pdserve binds no CPUs (`auto` placement) and "
                             "keeps your count", "one per CPU of the placement")
    gomp_spincount = _as_is("libgomp's; pdserve sets a bounded spin where the engine owns its "
                            "cores", "30000 there")
    omp_proc_bind = _as_is("OpenMP's; `close` where the engine is bound to a CPU list",
                           "close there")
    omp_places = _as_is("OpenMP's; one place per bound CPU", "the bound CPUs")
    onednn_primitive_cache_capacity = _as_is("oneDNN's primitive cache (#21's memory bound)",
                                             "64")
    aten_cpu_capability = _as_is("torch's kernels; set from PDCORE_CPU_ISA", "unset")
    onednn_max_cpu_isa = _as_is("oneDNN's; set from PDCORE_CPU_ISA", "unset")
    malloc_trim_threshold_ = _as_is(
        "glibc's own; set any of these three and the engine leaves the allocator alone (by "
        "default it keeps freed step memory for the next step, handed back when idle)")
    malloc_mmap_threshold_ = _as_is("glibc's own (see MALLOC_TRIM_THRESHOLD_)")
    glibc_tunables = _as_is("glibc's own (see MALLOC_TRIM_THRESHOLD_)")


class System(Group):
    __slots__ = ()
    TOPIC = "Read from the system"
    xdg_runtime_dir = _as_is("where prefill servers announce their bootstrap ports "
                             "(`pdserve-prefill`) and `pdserve up` keeps its state")
    xdg_state_home = _as_is("`pdserve up`'s state without XDG_RUNTIME_DIR", "~/.local/state")
    xdg_cache_home = _as_is("above converted GGUF models (`pdserve/`)", "~/.cache")
    kubernetes_service_host = _as_is("set in a pod: the router's `--service-discovery` uses "
                                     "the in-cluster credentials")
    kubeconfig = _as_is("the router's `--service-discovery` credentials outside a pod",
                        "~/.kube/config")
    cxx = _as_is("the C++ compiler of the native kernels", "g++")


class Tests(Group):
    __slots__ = ()
    TOPIC = "Tests and internals"
    pdserve_env_defaulted = Var("", text, "which variables pdserve itself defaulted (internal)",
                                shown="set by pdserve")
    pdserve_port_dir: Var[str | None] = Var(
        None, text, "where test processes claim free ports (pdcore.testing)",
        shown="a folder under the temp dir")
    pdcore_keep_test_logs = Var(False, not_zero,
                                "1 keeps test servers' logs and temp folders")
    pdcore_test_hold_gate: Var[str | None] = Var(
        None, text, "the gate file of `python -m pdcore.testing.held_transfer` (required "
        "there): its tcp sends wait while the file reads `hold`")
    pdserve_test_stall_after_send_s = Var(
        0.0, number, "fault tests: the HTTP process blocks this long after each request it "
        "hands its scheduler (as if the OS preempted it between two sends); 0: off",
        shown="0")


GROUPS: tuple[type[Group], ...] = (Disagg, Secrets, Backends, Engine, Http, Libraries, System,
                                   Tests)


class Env(Disagg, Secrets, Backends, Engine, Http, Libraries, System, Tests):
    """The environment as typed fields: `Env()` reads this process's (at each access),
    `Env(mapping)` the given one."""
    __slots__ = ("source",)

    def __init__(self, source: Mapping[str, str] | None = None) -> None:
        self.source = source

    def is_set(self, name: str) -> bool:
        """Whether the declared variable `name` is in the environment (even empty)."""
        return by_name(name).is_set(self.source)

    def raw(self, name: str) -> str | None:
        """The declared variable `name` as set, unparsed (None: unset)."""
        return by_name(name).raw(self.source)


ENV = Env()  # this process's environment, read at each access


def declared() -> Iterator[Var[Any]]:
    """Every declared variable, in the documentation's order."""
    for group in GROUPS:
        yield from (v for v in vars(group).values() if isinstance(v, Var))


def by_name(name: str) -> Var[Any]:
    for v in declared():
        if v.name == name:
            return v
    raise KeyError(f"{name} is not declared in pdcore/env.py")


def check(source: Mapping[str, str] | None = None) -> None:
    """Read every declared variable; EnvError naming each one whose value cannot be used (the
    entry points call this before they start anything)."""
    bad = []
    for v in declared():
        try:
            v.read(source)
        except EnvError as e:
            bad.append(str(e))
    if bad:
        raise EnvError("; ".join(bad))


def environ() -> dict[str, str]:
    """A copy of this process's environment, for code that reads a mapping handed to it."""
    return dict(os.environ)


def child_environ(extra: Mapping[str, str | None] | None = None) -> dict[str, str]:
    """The environment for a process we start: this one's, with `extra` set (None removes)."""
    out = dict(os.environ)
    for k, v in (extra or {}).items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = v
    return out


def put(values: Mapping[str, str | None]) -> None:
    """Set variables in this process's environment (None removes): only for what a library
    loaded later in this process, or a child started from it, reads (runtime_env.py)."""
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
