"""Every environment variable pdserve and its first-party plugins read: name, default and
meaning, in one declaration. docs/environment.md is generated from it (`python -m
pdcore.docs_gen`), and tests/test_docs_gen.py checks that every such name in the sources is
declared here, so the table cannot fall behind the code. The modules that read a variable keep
their own constants; this is the list a user reads."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EnvVar:
    name: str
    default: str
    meaning: str
    topic: str  # the section of docs/environment.md


PD = "PD disaggregation (SGLang's names)"
SEC = "Secrets and trust"
ENGINE = "Engine and CPU"
HTTP = "HTTP and requests"
BACKENDS = "Transfer backends and plugins"
TESTS = "Tests and internals"

ENV_VARS: tuple[EnvVar, ...] = (
    EnvVar("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", "300",
           "P waits this many seconds for D's destination pages", PD),
    EnvVar("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", "300",
           "D waits this many seconds for the KV (Transferring included)", PD),
    EnvVar("PDSERVE_DISAGGREGATION_CLAIM_TIMEOUT", "5",
           "P fails a room no decode server claimed within this many seconds (D claims on "
           "admission; a refused route never claims); D frees a room P did not confirm "
           "within 6 times it (D reserves pages only after P confirmed)", PD),
    EnvVar("SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL", "5.0",
           "seconds between D's checks of each P's bootstrap `/health`", PD),
    EnvVar("SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE", "2",
           "failed heartbeats before P is declared lost", PD),
    EnvVar("SGLANG_DISAGGREGATION_THREAD_POOL_SIZE", "min(max(4, int(0.75 x cpus) // 8), 12)",
           "transfer threads per rank", PD),
    EnvVar("SGLANG_DISAGGREGATION_QUEUE_SIZE", "4", "transfer queues, sharded by decode session",
           PD),
    EnvVar("SGLANG_DISAGGREGATION_BOOTSTRAP_ENTRY_CLEANUP_INTERVAL", "120",
           "seconds after which stale bootstrap entries are dropped", PD),
    EnvVar("SGLANG_DISAGG_STAGING_BUFFER", "off",
           "a staging buffer for P and D at different TP sizes (pd-staging)", PD),
    EnvVar("SGLANG_DISAGG_STAGING_BUFFER_SIZE_MB", "64", "the staging buffer's size (pd-staging)",
           PD),
    EnvVar("SGLANG_DISAGG_STAGING_POOL_SIZE_MB", "4096", "the staging pool's size (pd-staging)",
           PD),
    EnvVar("DISAGGREGATION_TEST_FAILURE_PROB", "0",
           "fail this fraction of rooms on purpose (fault tests)", PD),
    EnvVar("PDSERVE_DISAGGREGATION_AUTH_TOKEN", "unset",
           "the cluster secret (`--disaggregation-auth-token`; docs/security.md)", SEC),
    EnvVar("PDSERVE_DISAGGREGATION_TRUST_LOCAL_PREFILL", "1",
           "`0`: a decode server no longer trusts unsigned loopback routes to the bootstrap "
           "ports this user's live prefill servers on this host announced", SEC),
    EnvVar("PDSERVE_DISAGGREGATION_AUTH_TOKEN_FILE", "unset",
           "a file holding the cluster secret (Kubernetes mounts it so)", SEC),
    EnvVar("PDSERVE_ADMIN_API_KEY", "unset",
           "the admin key (`--admin-api-key`): the only key of the admin routes, which are off "
           "without it (docs/security.md)", SEC),
    EnvVar("PDSERVE_ADMIN_API_KEY_FILE", "unset",
           "a file holding the admin key (Kubernetes mounts it so)", SEC),
    EnvVar("PDCORE_PLUGINS", "all", "plugins to load (comma-separated names)", BACKENDS),
    EnvVar("PDCORE_DISABLE_PLUGINS", "none", "plugins not to load", BACKENDS),
    EnvVar("PDCORE_TCP_TIMEOUT", "30", "tcp backend: seconds a transfer may wait on its peer",
           BACKENDS),
    EnvVar("PDCORE_SHM_MODE", "auto", "shm backend: `auto`, `cma` or `segment` (same on every "
           "server)", BACKENDS),
    EnvVar("PDCORE_SHM_COPY", "vm", "shm segment mode's copy: `vm` or `memmove`", BACKENDS),
    EnvVar("PDCORE_SHM_TIMEOUT", "30", "shm backend: seconds per batch", BACKENDS),
    EnvVar("PDCORE_HOST_ID", "hostname + boot id",
           "who shares /dev/shm with this process (tests fake other hosts with it)", BACKENDS),
    EnvVar("MOONCAKE_PROTOCOL", "rdma", "pd-mooncake: `rdma`, `tcp` or `efa`", BACKENDS),
    EnvVar("MC_FORCE_TCP", "unset", "pd-mooncake: TCP whenever the variable exists", BACKENDS),
    EnvVar("MC_FORCE_HCA", "unset", "pd-mooncake: no TCP fallback without an RDMA NIC",
           BACKENDS),
    EnvVar("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", "1024",
           "pd-mooncake: queued transfers per peer (bounds a batch)", BACKENDS),
    EnvVar("MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER", "1024",
           "pd-mooncake: pending admissions per peer", BACKENDS),
    EnvVar("MC_TRANSFER_TIMEOUT", "30", "pd-mooncake: seconds before a batch counts as timed out",
           BACKENDS),
    EnvVar("SGLANG_MOONCAKE_CUSTOM_MEM_POOL", "unset",
           "pd-mooncake: a CUDA memory pool (`NVLINK`, `BAREX`, `INTRA_NODE_NVLINK`)", BACKENDS),
    EnvVar("MC_FORCE_MNNVL", "unset", "pd-mooncake: the NVLink pool's companion switch",
           BACKENDS),
    EnvVar("MC_INTRANODE_NVLINK", "unset", "pd-mooncake: the intra-node NVLink pool's switch",
           BACKENDS),
    EnvVar("SGLANG_DISAGGREGATION_NIXL_BACKEND", "UCX", "pd-nixl: NIXL's transport plugin",
           BACKENDS),
    EnvVar("SGLANG_DISAGGREGATION_NIXL_BACKEND_PARAMS", "{}",
           "pd-nixl: the plugin's parameters (a JSON object)", BACKENDS),
    EnvVar("PDCORE_NIXL_PROGRESS", "pump",
           "pd-nixl: `pump` (a pdserve thread polls) or `thread` (NIXL's own, a whole core)",
           BACKENDS),
    EnvVar("PDCORE_NIXL_PUMP_MS", "1", "pd-nixl: the pump's period", BACKENDS),
    EnvVar("NIXL_PLUGIN_DIR", "the wheel's", "pd-nixl: where NIXL finds its plugins", BACKENDS),
    EnvVar("ASCEND_MF_STORE_URL", "unset", "pd-ascend: the memfabric store", BACKENDS),
    EnvVar("ASCEND_MF_TRANSFER_PROTOCOL", "unset", "pd-ascend: the memfabric protocol", BACKENDS),
    EnvVar("ENABLE_ASCEND_TRANSFER_WITH_MOONCAKE", "false",
           "pd-ascend: move KV with Mooncake's Ascend build", BACKENDS),
    EnvVar("ASCEND_NPU_PHY_ID", "the logical id",
           "pd-ascend: the physical NPU id where a container renumbers devices", BACKENDS),
    EnvVar("ASCEND_RT_VISIBLE_DEVICES", "all", "pd-ascend: the NPUs this process sees (CANN's)",
           BACKENDS),
    EnvVar("PDCORE_CPU_PACKED_GEMM", "1",
           "linear layers on packed weights, which replace the originals: panels for the"
           " native GEMMs (float32 on AVX-512 or AVX2, bf16 on AVX-512 BF16) or oneDNN-"
           "reordered (AMX tiles for bf16 where the CPU has AMX)", ENGINE),
    EnvVar("PDCORE_GEMM_LAYOUT", "auto",
           "which packed layout: `auto` times both on each weight shape at load (decode-"
           "sized rows weighted 16:1 against a 256-row prefill chunk) and keeps the "
           "faster; `panels` or `onednn` fix it (/metrics: "
           "`pdserve_scheduler_gemm_weights_*`)", ENGINE),
    EnvVar("PDCORE_CPU_ISA", "auto",
           "run as a CPU with less than this one: `avx2` (no AVX-512, no bf16 hardware: "
           "AMD Zen 2) or `avx512` (AVX-512 with BF16, no AMX: AMD Zen 4); torch's "
           "kernels, oneDNN's and the `--dtype bfloat16` check follow it", ENGINE),
    EnvVar("PDCORE_CPUINFO", "/proc/cpuinfo", "the CPU description to read (tests)", ENGINE),
    EnvVar("PDCORE_NATIVE", "1",
           "the engine's native kernels (panel GEMMs, decode attention, decode layer "
           "loop), compiled once per machine and ISA with g++; 0 runs without them", ENGINE),
    EnvVar("PDCORE_NATIVE_ISA", "auto",
           "which native library: `avx512`, `avx2` (an ISA the CPU lacks: none, and the "
           "log says why) or `off`; auto: the best the CPU has; any other value stops "
           "the server (exit 2)", ENGINE),
    EnvVar("PDSERVE_NATIVE_DIR", "~/.cache/pdserve/native",
           "where the native library is built (once per machine, under a lock)", ENGINE),
    EnvVar("PDCORE_DECODE_KV_VIEW_MB", "128",
           "MiB of decode K/V kept contiguous per request beside the pool; 0 gathers every step",
           ENGINE),
    EnvVar("PDSERVE_CPU_OMP_THREADS_BIND", "auto",
           "CPU placement of the engine's OpenMP threads (`--cpu-omp-threads-bind`)", ENGINE),
    EnvVar("PDCORE_HOST_SERVERS", "1",
           "servers sharing this host's KV budget (`pdserve up` sets it)", ENGINE),
    EnvVar("PDCORE_TP_TIMEOUT", "600", "seconds a TP collective may wait", ENGINE),
    EnvVar("PDCORE_GGUF_CACHE", "1", "load a .gguf model through a converted copy", ENGINE),
    EnvVar("PDCORE_CACHE_DIR", "~/.cache/pdserve", "where converted GGUF models are kept",
           ENGINE),
    EnvVar("PDSERVE_SPEC_GATE", "1",
           "speculative decoding verifies drafts only when the measured verify/decode "
           "step cost pays; 0 verifies every draft (identity tests, measurements)", ENGINE),
    EnvVar("PDSERVE_JUMP_FORWARD", "1",
           "constrained requests draft what their grammar forces next, verified in one "
           "forward pass (TP 1; 0: one token per step)", ENGINE),
    EnvVar("PDSERVE_GRAMMAR_COMPILE_TIMEOUT_S", "30",
           "a constrained request whose grammar (json_schema, regex, ebnf, a forced tool"
           " call) is still compiling after this many seconds gets 400; compiles run "
           "beside the scheduler, never in its step", HTTP),
    EnvVar("PDCORE_MAX_REQUEST_BYTES", "4194304", "largest request body (413 beyond)", HTTP),
    EnvVar("PDSERVE_HTTP_HEADER_TIMEOUT_S", "10",
           "seconds from a connection's first byte to its complete headers", HTTP),
    EnvVar("PDSERVE_HTTP_BODY_TIMEOUT_S", "30",
           "seconds from a request's headers to its whole body, plus 1 s per "
           "PDSERVE_HTTP_BODY_MIN_RATE bytes received (else 408)", HTTP),
    EnvVar("PDSERVE_HTTP_BODY_MIN_RATE", "1024",
           "bytes of body that buy one more second of the body deadline", HTTP),
    EnvVar("PDSERVE_HTTP_BODY_MAX_S", "300", "no request body takes longer than this", HTTP),
    EnvVar("PDSERVE_HTTP_SEND_TIMEOUT_S", "60",
           "seconds a client may leave its response unread (writes paused) before it is closed "
           "and its request aborted", HTTP),
    EnvVar("PDSERVE_HTTP_MAX_CONNECTIONS", "4096",
           "open connections per port (at most the descriptor limit less 512)", HTTP),
    EnvVar("PDSERVE_HTTP_MAX_PENDING_PER_PEER", "128",
           "connections one peer (IPv4 address, IPv6 /64, all of loopback) may hold while they "
           "read their request; the next evicts that peer's slowest", HTTP),
    EnvVar("PDSERVE_HTTP_KEEPALIVE_S", "120", "idle keep-alive connections stay this long",
           HTTP),
    EnvVar("PDSERVE_ENV_DEFAULTED", "set by pdserve",
           "which variables pdserve itself defaulted (internal)", TESTS),
    EnvVar("PDSERVE_PORT_DIR", "a folder under the temp dir",
           "where test processes claim free ports (pdcore.testing)", TESTS),
    EnvVar("PDCORE_KEEP_TEST_LOGS", "0", "1 keeps test servers' logs and temp folders", TESTS),
)

# names in the sources that look like variables but are not (prefixes, constants, error codes)
NOT_VARIABLES = frozenset({
    "SGLANG_DISAGGREGATION_", "SGLANG_DISAGG_", "SGLANG_DISAGG_STAGING_POOL_", "MOONCAKE_POOLS",
    "MOONCAKE_VAR", "NIXL_ERRORS", "NIXL_ERR_BACKEND", "NIXL_ERR_INVALID_PARAM",
    "NIXL_ERR_NOT_FOUND", "NIXL_ERR_REMOTE_DISCONNECT", "NIXL_MEM",
})
# the prefixes a variable of ours (or of a library we configure) starts with
PREFIXES = ("PDCORE_", "PDSERVE_", "SGLANG_", "MOONCAKE_", "MC_", "ASCEND_", "NIXL_",
            "ENABLE_ASCEND_", "DISAGGREGATION_")

GLIBC = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES")
ENV_VARS += tuple(
    EnvVar(name, "unset", "glibc's own; set any and the engine leaves the allocator alone (by "
           "default it keeps freed step memory for the next step, handed back when idle)", ENGINE)
    for name in GLIBC)
