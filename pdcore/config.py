"""One typed configuration tree. The only module that reads environment variables.

`ServerArgs` holds every `pdserve serve` flag (the CLI flags are generated from its fields);
`DisaggEnv` holds the SGLANG_DISAGGREGATION_* / SGLANG_DISAGG_* variables of the seed pages,
read once at start-up by `DisaggEnv.from_env()`.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

from pdcore.common_flags import CommonFlags
from pdcore.env import Env, by_name, environ
from pdcore.errors import ConfigError
from pdcore.route_auth import parse_addrs

DISAGG_MODES = ("null", "prefill", "decode")
LOAD_BALANCE_METHODS = ("round_robin", "shortest_queue", "minimum_tokens")  # SGLang's names
DEFAULT_BOOTSTRAP_PORT = 8998
# SGLang's --quantization names (its server_args QUANTIZATION_CHOICES): every one is accepted
# by the parser, so a SGLang command line parses; pdserve runs
# the ones engine/model/quant_config.py's RUNS lists
QUANT_CHOICES = (
    "awq", "fp8", "mxfp8", "gptq", "marlin", "gptq_marlin", "awq_marlin", "bitsandbytes", "gguf",
    "modelopt", "modelopt_fp8", "modelopt_fp4", "nvfp4_online", "modelopt_mixed", "petit_nvfp4",
    "w8a8_int8", "w8a8_fp8", "moe_wna16", "w4afp8", "mxfp4", "auto-round", "auto-round-int8",
    "compressed-tensors", "modelslim", "mxfp_w4a8", "quark", "quark_int4fp8_moe", "quark_mxfp4",
    "mlx_q4", "mlx_q8", "unquant", "humming",
)
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "fp8_e4m3", "fp8_e5m2")
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
MOE_A2A_BACKENDS = ("none", "deepep")
DEEPEP_MODES = ("normal", "low_latency", "auto")
# SGLang's --speculative-algorithm names; pdserve builds NGRAM (pdcore/engine/sched/drafter.py)
# and the draft-head chains of EAGLE, EAGLE3 and NEXTN (pdcore/engine/sched/eagle.py), verified
# in pdcore/engine/sched/speculative.py
SPEC_ALGORITHMS = ("NGRAM", "EAGLE", "EAGLE3", "NEXTN", "STANDALONE")
SPEC_BUILT = ("NGRAM", "EAGLE", "EAGLE3", "NEXTN")
SPEC_HEADS = ("EAGLE", "EAGLE3", "NEXTN")  # a draft head's chain: --speculative-num-steps, topk 1
EAGLE_NUM_STEPS = 3  # --speculative-num-steps default for EAGLE / NEXTN: chains of 3 drafts
NGRAM_MATCH_TYPES = ("BFS", "PROB")
SAMPLING_DEFAULTS = ("model", "openai")
NGRAM_DRAFT_TOKENS = 8  # --speculative-num-draft-tokens default: the current token + 7 drafts


@dataclass
class ServerArgs(CommonFlags):
    # model
    model_path: str | None = None
    tokenizer_path: str | None = None
    served_model_name: str | None = None
    trust_remote_code: bool = False
    dtype: str = "auto"  # auto -> float32 on cpu, bfloat16 on accelerators
    quantization: str | None = None  # SGLang's names, read from the checkpoint (model/quant_config)
    context_length: int | None = None
    load_format: str = "auto"  # auto | safetensors | gguf | dummy (random weights, real shapes)
    chat_template: str | None = None  # Jinja file replacing the tokenizer's chat template
    # special-token spellings inside chat messages become special tokens (off: text)
    allow_special_tokens_in_messages: bool = False
    random_seed: int | None = None
    # server
    host: str = "127.0.0.1"
    port: int = 30000
    log_level: str = "info"
    api_key: str | None = None  # bearer token required on every route but /health
    # the admin routes' own key (pdcore.edge.auth); unset: admin routes are off
    admin_api_key: str | None = None
    log_requests: bool = False
    enable_metrics: bool = False  # /metrics is always on; accepted for SGLang parity
    disable_cuda_graph: bool = False  # no CUDA graphs are ever captured; accepted for parity
    cuda_graph_bs: list[int] | None = None  # CUDA-graph batch sizes: accepted, a warning says so
    skip_server_warmup: bool = False
    drain_timeout: float | None = None  # None: $PDSERVE_DRAIN_TIMEOUT_S (30 s)
    tokenizer_worker_num: int = 1
    # parallelism / devices
    tp_size: int = 1
    dp_size: int = 1
    load_balance_method: str = "round_robin"  # --dp-size > 1: how requests pick a replica
    # SGLang's decode flag: P and D must agree on a request's prefill DP rank; here they always
    # do (bootstrap_room % P's dp size, or the request's disagg_prefill_dp_rank): accepted
    prefill_round_robin_balance: bool = False
    # MoE: tp-size ranks split into dp-size attention groups (own scheduler and KV pool each),
    # experts over all tp-size ranks (pdcore.engine.parallel.dp_attention)
    enable_dp_attention: bool = False
    enable_dp_lm_head: bool = False  # accepted with DP attention: the lm head never spans DP ranks
    # set per DP rank by the controller, not flags: its index and where all its ranks meet
    dp_attention_rank: int = 0
    dp_attention_init: str = ""
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    base_gpu_id: int = 0
    device: str = "cpu"
    attention_backend: str | None = None
    memory_pool: str | None = None  # None -> the platform's default pool
    kv_cache_dtype: str = "auto"  # auto: the model's --dtype
    # CPU placement of the engine's OpenMP threads (pdcore.runtime_env): auto | all | nobind | 0-1
    cpu_omp_threads_bind: str | None = None
    # mixture of experts (pdcore/engine/model/moe.py)
    ep_size: int = 1  # > 1: the TP ranks hold whole experts and exchange tokens all-to-all
    moe_a2a_backend: str = "none"  # none: torch.distributed; deepep: DeepEP (CUDA only)
    deepep_mode: str = "auto"  # normal | low_latency | auto (DeepEP's kernels)
    enable_deepep_moe: bool = False  # older spelling of --moe-a2a-backend deepep
    disable_shared_experts_fusion: bool = False  # shared experts never fuse here: accepted
    ep_num_redundant_experts: int = 0  # only 0: experts are never replicated
    # memory and scheduling
    mem_fraction_static: float | None = None
    max_total_tokens: int | None = None
    page_size: int = 1
    max_running_requests: int = 64
    chunked_prefill_size: int = 2048
    max_prefill_tokens: int = 8192
    # the prefill tokens a step may carry while it also runs decodes (their gap between tokens
    # grows ~0.7 ms a prefill token on SmolLM2, 2 Zen 5 cores); -1: --chunked-prefill-size;
    # auto: chosen each step to keep the decodes' TPOT within --decode-tpot-target-ms
    # (engine/sched/budget.py)
    decode_step_prefill_tokens: int | str = 256
    decode_tpot_target_ms: float = 100.0
    disable_radix_cache: bool = False
    schedule_policy: str = "fcfs"
    # structured output (pdcore.constrained): xgrammar, as SGLang's default, or none
    grammar_backend: str = "xgrammar"
    constrained_json_disable_any_whitespace: bool = False
    tool_call_parser: str | None = None  # server/tools/tool_parsers.py: auto, llama3, qwen25, ...
    reasoning_parser: str | None = None  # server/tools/reasoning.py: deepseek-r1, qwen3, ...
    # the OpenAI routes' sampling values when a request names none: the model's
    # generation_config (SGLang's default) or OpenAI's (engine/model/source.sampling_defaults)
    sampling_defaults: str = "model"
    # speculative decoding (pdcore/engine/sched/speculative.py), SGLang's flags
    speculative_algorithm: str | None = None
    speculative_draft_model_path: str | None = None
    speculative_num_steps: int | None = None
    speculative_eagle_topk: int | None = None
    speculative_num_draft_tokens: int | None = None  # NGRAM: NGRAM_DRAFT_TOKENS
    speculative_draft_model_quantization: str | None = None
    enable_multi_layer_eagle: bool = False
    speculative_ngram_min_match_window_size: int = 1
    speculative_ngram_max_match_window_size: int = 12
    speculative_ngram_min_bfs_breadth: int = 1
    speculative_ngram_max_bfs_breadth: int = 10
    speculative_ngram_match_type: str = "BFS"
    speculative_ngram_branch_length: int = 18
    # entries of the cross-request n-gram cache (SGLang: trie nodes, 10M; each entry here holds
    # a whole continuation, so the default is smaller: about 40 MB)
    speculative_ngram_capacity: int = 100_000
    # disaggregation
    disaggregation_mode: str = "null"
    # None: mooncake when installed and available, else tcp (pdcore.plugins.default_backend)
    disaggregation_transfer_backend: str | None = None
    disaggregation_bootstrap_port: int = DEFAULT_BOOTSTRAP_PORT
    disaggregation_ib_device: str | None = None
    disaggregation_auth_token: str | None = None
    # prefill bootstrap addresses (HOST:PORT, comma separated) whose routes this server accepts
    # unsigned (pdcore.route_auth); signed routes need no entry
    disaggregation_trusted_prefill: str | None = None
    num_reserved_decode_tokens: int = 512
    # decode keeps finished requests' pages in its own prefix cache and tells prefill how many
    # leading prompt tokens it holds, so only the rest crosses (SGLang's flag; off by default)
    disaggregation_decode_enable_radix_cache: bool = False
    disaggregation_decode_polling_interval: int = 1
    # a scheduler step that hangs longer ends the server (SGLang's default); <= 0 disables
    watchdog_timeout: float = 300.0
    # profiling
    profile_output_dir: str | None = None
    # identity (not a flag): unique per server process, names shm segments, logs
    server_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    # identity (not flags), set per replica by --dp-size > 1 (pdcore.runtime.dp.client): the
    # replica's DP rank, and the PD route secret every replica of one prefill server shares
    dp_rank: int = 0
    pd_route_secret: str = ""

    def validate(self) -> None:
        self._check_choice("disaggregation_mode", DISAGG_MODES)
        for name in ("tp_size", "dp_size", "nnodes", "page_size", "max_running_requests"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1")
        self._check_choice("load_balance_method", LOAD_BALANCE_METHODS)
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError("--node-rank must be in [0, --nnodes)")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static <= 1:
            raise ConfigError("--mem-fraction-static must be in (0, 1]")
        if self.chunked_prefill_size == -1 or self.chunked_prefill_size == 0:
            self.chunked_prefill_size = 1 << 30  # -1 disables chunking, as in SGLang
        if self.chunked_prefill_size < 1:
            raise ConfigError("--chunked-prefill-size must be >= 1 (or -1 to disable chunking)")
        self.decode_step_prefill_tokens = _step_prefill(self.decode_step_prefill_tokens)
        if not 0 < self.decode_tpot_target_ms <= 60_000:
            raise ConfigError(f"--decode-tpot-target-ms {self.decode_tpot_target_ms}: must be "
                              "in (0, 60000] milliseconds")
        if self.context_length is not None and self.context_length < 2:
            raise ConfigError("--context-length must be >= 2")
        if not 0 < self.port < 65536 or not 0 < self.disaggregation_bootstrap_port < 65536:
            raise ConfigError("ports must be in 1..65535")
        self._check_choice("kv_cache_dtype", KV_CACHE_DTYPES)
        self._check_choice("load_format", LOAD_FORMATS)
        self._validate_moe()
        if self.tokenizer_worker_num != 1:
            raise ConfigError(
                f"--tokenizer-worker-num {self.tokenizer_worker_num}: only 1 is supported (the "
                "HTTP process tokenizes; run more servers behind the router to scale out)")
        check_keys(self.api_key, self.admin_api_key)
        if self.disaggregation_auth_token is not None and not self.disaggregation_auth_token:
            raise ConfigError("--disaggregation-auth-token must not be empty")
        try:
            parse_addrs(self.disaggregation_trusted_prefill)
        except ValueError as e:
            raise ConfigError(f"--disaggregation-trusted-prefill: {e}") from None
        self.validate_speculative()

    def _check_choice(self, name: str, allowed: tuple[str, ...]) -> None:
        value = getattr(self, name)
        if value not in allowed:
            raise ConfigError(f"--{name.replace('_', '-')} must be one of {', '.join(allowed)}, "
                              f"got {value!r}")

    def _validate_moe(self) -> None:
        if self.enable_deepep_moe:
            self.moe_a2a_backend = "deepep"
        self._check_choice("moe_a2a_backend", MOE_A2A_BACKENDS)
        self._check_choice("deepep_mode", DEEPEP_MODES)
        if self.ep_size < 1:
            raise ConfigError("--ep-size must be >= 1")
        if self.ep_size not in (1, self.tp_size):
            raise ConfigError(f"--ep-size {self.ep_size} must be 1 or equal to --tp-size "
                              f"{self.tp_size} (expert parallelism spans the whole TP group)")
        if self.ep_num_redundant_experts != 0:
            raise ConfigError(f"--ep-num-redundant-experts {self.ep_num_redundant_experts}: "
                              "only 0 is supported (experts are not replicated); drop the flag")

    def validate_speculative(self) -> None:
        algo = self.speculative_algorithm
        if algo is None:
            return
        self.speculative_algorithm = algo = algo.upper()
        self._check_choice("speculative_algorithm", SPEC_ALGORITHMS)
        given = [f for f in ("speculative_draft_model_path", "speculative_draft_model_quantization",
                             "speculative_num_steps", "speculative_eagle_topk")
                 if getattr(self, f) is not None] + (
            ["enable_multi_layer_eagle"] if self.enable_multi_layer_eagle else [])
        flags = ", ".join("--" + f.replace("_", "-") for f in given)
        named = given + (["speculative_num_draft_tokens"]
                         if self.speculative_num_draft_tokens is not None else [])
        line = ", ".join("--" + f.replace("_", "-") for f in named)
        if algo not in SPEC_BUILT:
            raise ConfigError(
                f"--speculative-algorithm {algo}{f' (with {line})' if line else ''} is not "
                "built yet: it needs a draft model pdserve does not load; built are NGRAM "
                "(drafts from the request's own context, no draft model), EAGLE (an EAGLE-1 "
                "draft head, chain drafts), EAGLE3 (an EAGLE-3 draft head, chain drafts) and NEXTN "
                "(a DeepSeek-V3 model's own MTP layer, chain drafts). Use one of those, or drop "
                "the speculative flags")
        if algo in SPEC_HEADS:
            self._validate_head(algo, f"--speculative-algorithm {algo}"
                                      f"{f' (with {line})' if line else ''}")
            return
        if given:
            raise ConfigError(f"{flags}: NGRAM runs no draft model and drafts a chain; drop "
                              "them (the draft length is --speculative-num-draft-tokens)")
        if self.speculative_num_draft_tokens is None:
            self.speculative_num_draft_tokens = NGRAM_DRAFT_TOKENS
        if not 1 <= self.speculative_num_draft_tokens <= 64:
            raise ConfigError("--speculative-num-draft-tokens must be in [1, 64] (1: no drafts)")
        lo, hi = (self.speculative_ngram_min_match_window_size,
                  self.speculative_ngram_max_match_window_size)
        if not 1 <= lo <= hi <= 64:
            raise ConfigError("the NGRAM match windows need 1 <= --speculative-ngram-min-match-"
                              "window-size <= --speculative-ngram-max-match-window-size <= 64")
        self._check_choice("speculative_ngram_match_type", NGRAM_MATCH_TYPES)
        if self.speculative_ngram_branch_length < 1 or self.speculative_ngram_capacity < 0:
            raise ConfigError("--speculative-ngram-branch-length must be >= 1 and "
                              "--speculative-ngram-capacity >= 0")

    def _validate_head(self, algo: str, line: str) -> None:
        """EAGLE (an EAGLE-1 head), EAGLE3 (an EAGLE-3 head over three of the target's layers,
        engine/model/eagle3.py) and NEXTN (the model's own MTP layer; its folder unless
        --speculative-draft-model-path names another): a chain of --speculative-num-steps
        drafts, unified or PD mode (prefill runs the head over the prompt, its K/V travel with
        the target's as one more KV layer; NEXTN's one more MLA latent layer), with any
        --tp-size (the head's layer sharded as the target's, every rank runs its passes, rank
        0's draft tokens agreed: engine/sched/draft_tp.py). With --enable-dp-attention (unified or
        PD: each DP rank's pool holds its head layer, which moves with that rank's pages) the
        head runs in each DP rank's attention group on that DP rank's batch;
        NEXTN's MTP layer holds a MoE layer whose collectives span the DP ranks, so every DP
        rank pads its head passes to the same count per step (engine/parallel/dp_heads.py).
        --enable-multi-layer-eagle (EAGLE or NEXTN, any --tp-size, each layer sharded as the
        target's): the N >= 2 MTP layers of a MiMo checkpoint (the model's own folder unless
        --speculative-draft-model-path names another) draft, chain step j with layer
        min(j, N - 1), each layer its own KV layer.
        `line`: the flags given, named in every refusal. Whether the model has the MTP layers
        is the preflight's and the engine's to check (they read the model)."""
        why = [(self.speculative_draft_model_quantization not in (None, *QUANT_CHOICES),
                (f"--speculative-draft-model-quantization "
                 f"{self.speculative_draft_model_quantization}: not a quantization method "
                 "SGLang or pdserve knows (the draft's checkpoint is checked as --quantization "
                 "checks the target's)")),
               (algo == "EAGLE" and not self.speculative_draft_model_path
                and not self.enable_multi_layer_eagle,
                ("needs --speculative-draft-model-path: an HF folder of an EAGLE-1 draft head "
                 "(config.json with architectures [\"LlamaForCausalLMEagle\"], safetensors)")),
               (algo == "EAGLE3" and self.enable_multi_layer_eagle,
                ("--enable-multi-layer-eagle: a MiMo's own MTP layers draft with EAGLE or "
                 "NEXTN; EAGLE3 drafts with a one-layer EAGLE-3 head")),
               (algo == "EAGLE3" and not self.speculative_draft_model_path,
                ("needs --speculative-draft-model-path: an HF folder of an EAGLE-3 draft head "
                 "(config.json with architectures [\"LlamaForCausalLMEagle3\"], "
                 "safetensors)"))]
        for bad, what in why:
            if bad:
                raise ConfigError(f"{line}: {what}")
        if self.speculative_eagle_topk is None:
            self.speculative_eagle_topk = 1
        if self.speculative_eagle_topk != 1:
            raise ConfigError(f"--speculative-eagle-topk {self.speculative_eagle_topk}: only 1 "
                              "(chain drafts) is built; tree drafts (topk > 1) are not")
        steps = self.speculative_num_steps
        if steps is None:
            steps = (self.speculative_num_draft_tokens - 1
                     if self.speculative_num_draft_tokens is not None else EAGLE_NUM_STEPS)
        if not 1 <= steps <= 63:
            raise ConfigError("--speculative-num-steps must be in [1, 63] (draft tokens per "
                              "chain)")
        self.speculative_num_steps = steps
        if self.speculative_num_draft_tokens is None:
            self.speculative_num_draft_tokens = steps + 1
        if self.speculative_num_draft_tokens != steps + 1:
            raise ConfigError(f"--speculative-num-draft-tokens {self.speculative_num_draft_tokens}"
                              f" with --speculative-num-steps {steps} and topk 1: a chain "
                              f"verifies the current token + its {steps} drafts, so it must "
                              f"be {steps + 1} (or left out)")

    # set by the server for its engine processes (a DP replica's rank, the route secret, ...),
    # never by a user: no flag
    INTERNAL_FIELDS = ("server_id", "dp_attention_rank", "dp_attention_init", "dp_rank",
                       "pd_route_secret")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls) if f.name not in cls.INTERNAL_FIELDS]


CLUSTER_SECRET_ENV = Env.pdserve_disaggregation_auth_token.name
# a file holding it (a Kubernetes secret mounted as a volume: a file, not an environment
# variable that every process of the container and `kubectl describe` of a crash can show)
CLUSTER_SECRET_FILE_ENV = Env.pdserve_disaggregation_auth_token_file.name
MAX_SECRET_FILE_BYTES = 4096


def _step_prefill(value: int | str) -> int | str:
    """--decode-step-prefill-tokens: `auto`, a count >= 1 or -1 (the chunk size)."""
    text = str(value).strip().lower()
    if text == "auto":
        return text
    n = int(text) if text.lstrip("-").isdigit() and not isinstance(value, bool) else 0
    if n < 1 and n != -1:
        raise ConfigError(f"--decode-step-prefill-tokens {value}: must be auto, a count >= 1 or "
                          "-1 (the chunk size)")
    return n


def cluster_secret(flag_value: str | None, env: Mapping[str, str] | None = None) -> str | None:
    """The cluster secret: the flag, else $PDSERVE_DISAGGREGATION_AUTH_TOKEN (how `pdserve up`
    hands it over: a process's environment is not world-readable as its argv is), else the
    contents of the file $PDSERVE_DISAGGREGATION_AUTH_TOKEN_FILE names (surrounding whitespace
    stripped). ConfigError when that file cannot be read or holds nothing."""
    return _secret(flag_value, env, CLUSTER_SECRET_ENV, CLUSTER_SECRET_FILE_ENV,
                   "the cluster secret")


# the admin key (--admin-api-key): the only credential of the admin routes, on servers and
# router; handed over like the cluster secret (`pdserve up` draws one per cluster)
ADMIN_KEY_ENV = Env.pdserve_admin_api_key.name
ADMIN_KEY_FILE_ENV = Env.pdserve_admin_api_key_file.name


def admin_api_key(flag_value: str | None, env: Mapping[str, str] | None = None) -> str | None:
    """--admin-api-key, else $PDSERVE_ADMIN_API_KEY, else the contents of the file
    $PDSERVE_ADMIN_API_KEY_FILE names; None: the admin routes are off."""
    return _secret(flag_value, env, ADMIN_KEY_ENV, ADMIN_KEY_FILE_ENV, "the admin key")


def check_keys(api_key: str | None, admin_key: str | None) -> None:
    """Both keys non-empty when given, and different: the inference key must never open the
    admin routes."""
    if api_key is not None and not api_key.strip():
        raise ConfigError("--api-key must not be empty")
    if admin_key is not None and not admin_key.strip():
        raise ConfigError("--admin-api-key must not be empty")
    if api_key and admin_key and api_key.strip() == admin_key.strip():
        raise ConfigError("--admin-api-key must differ from --api-key: every API user holds the "
                          "API key, and it must not open the admin routes")


def _secret(flag_value: str | None, env: Mapping[str, str] | None, env_name: str,
            file_env: str, what: str) -> str | None:
    if flag_value:
        return flag_value
    raw = by_name(env_name).read(env)
    if raw:
        return raw
    path = by_name(file_env).read(env)
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_SECRET_FILE_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"{file_env}={path}: cannot read {what} ({e.strerror})") from None
    secret = data.decode("utf-8", "replace").strip()
    if not secret or len(data) > MAX_SECRET_FILE_BYTES:
        raise ConfigError(f"{file_env}={path}: the file must hold {what} "
                          f"(1 to {MAX_SECRET_FILE_BYTES} bytes)")
    return secret


# how many servers on this host share its KV budget (engine/build.py's kv_pool_tokens splits it
# evenly): `pdserve up` sets it to the number of servers it starts, unless the user sized the
# pools (--max-total-tokens, --mem-fraction-static), so its P + D servers together take the KV
# memory one server would
HOST_SERVERS_ENV = Env.pdcore_host_servers.name


def host_servers(env: Mapping[str, str] | None = None) -> int:
    """PDCORE_HOST_SERVERS as a count >= 1 (1 when unset); ConfigError for anything else."""
    return Env(env).pdcore_host_servers


# speculative decoding verifies drafts only when the measured cost pays (engine/sched/speculative.py);
# 0 verifies every draft (tests of identity and measurements of the verify pass itself)


def spec_gate(env: Mapping[str, str] | None = None) -> bool:
    return Env(env).pdserve_spec_gate


# a constrained request drafts what its grammar forces next (jump-forward), verified like any
# draft; 0 turns it off


def jump_forward(env: Mapping[str, str] | None = None) -> bool:
    return Env(env).pdserve_jump_forward


def default_thread_pool_size(cpu_count: int | None = None) -> int:
    """The seed's formula: int(0.75 * cpu_count) // 8, clamped to [4, 12]."""
    cpus = cpu_count or os.cpu_count() or 1
    return min(max(4, int(0.75 * cpus) // 8), 12)


@dataclass(frozen=True)
class DisaggEnv:
    bootstrap_timeout: float = 300.0
    waiting_timeout: float = 300.0
    heartbeat_interval: float = 5.0
    heartbeat_max_failure: int = 2
    thread_pool_size: int = 4
    queue_size: int = 4
    bootstrap_entry_cleanup_interval: float = 120.0
    claim_timeout: float = 5.0  # P: a room no decode server claimed; D: 6x, P's confirmation
    staging_buffer: bool = False
    staging_buffer_size_mb: int = 64
    staging_pool_size_mb: int = 4096
    test_failure_prob: float = 0.0
    raw: Mapping[str, str] = field(default_factory=dict)  # the whole environment, for backends

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> DisaggEnv:
        env = environ() if env is None else dict(env)
        e, p = Env(env), "SGLANG_DISAGGREGATION_"
        queue_size = e.sglang_disaggregation_queue_size
        pool = e.sglang_disaggregation_thread_pool_size or default_thread_pool_size()
        if queue_size < 1:
            raise ConfigError(f"{p}QUEUE_SIZE must be >= 1")
        if pool < queue_size:
            raise ConfigError(f"{p}THREAD_POOL_SIZE ({pool}) must be >= {p}QUEUE_SIZE ({queue_size})")
        out = cls(
            bootstrap_timeout=e.sglang_disaggregation_bootstrap_timeout,
            waiting_timeout=e.sglang_disaggregation_waiting_timeout,
            heartbeat_interval=e.sglang_disaggregation_heartbeat_interval,
            heartbeat_max_failure=e.sglang_disaggregation_heartbeat_max_failure,
            thread_pool_size=pool,
            queue_size=queue_size,
            bootstrap_entry_cleanup_interval=(
                e.sglang_disaggregation_bootstrap_entry_cleanup_interval),
            claim_timeout=e.pdserve_disaggregation_claim_timeout,
            staging_buffer=e.sglang_disagg_staging_buffer,
            staging_buffer_size_mb=e.sglang_disagg_staging_buffer_size_mb,
            staging_pool_size_mb=e.sglang_disagg_staging_pool_size_mb,
            test_failure_prob=e.disaggregation_test_failure_prob,
            raw=env,
        )
        for name in ("bootstrap_timeout", "waiting_timeout", "heartbeat_interval"):
            if getattr(out, name) <= 0:
                raise ConfigError(f"{p}{name.upper()} must be > 0")
        if out.claim_timeout <= 0:
            raise ConfigError("PDSERVE_DISAGGREGATION_CLAIM_TIMEOUT must be > 0")
        return out
