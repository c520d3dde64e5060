"""SGLang's common server flags (issue #45 item 12): what each does here, its check, and
SGLang's --config FILE. The fields live on ServerArgs (pdcore/config.py); a flag that cannot work
here is refused at start-up with the reason (exit 2)."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from pdcore.config import ServerArgs
from pdcore.messages.io import SamplingParams
from pdcore.errors import ConfigError

TOKENIZER_MODES = ("auto", "slow")
# the sampling fields --preferred-sampling-params may set (declared on SamplingParams)
PREFERRED_SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams)
                                  if f.metadata.get("preferable"))


def json_object_flag(raw: str | None, flag: str) -> dict[str, Any]:
    """A flag holding a JSON object (--json-model-override-args, --preferred-sampling-params)
    parsed, or ConfigError naming the flag."""
    if raw is None or not raw.strip():
        return {}
    try:
        value = json.loads(raw)
    except ValueError as e:
        raise ConfigError(f"{flag} must be a JSON object, e.g. '{{\"temperature\": 0.7}}': "
                          f"{e}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{flag} must be a JSON object, got {type(value).__name__}")
    return value


def validate_common_flags(args: ServerArgs) -> None:
    """SGLang's common flags (#45 item 12): each checked here, or refused naming why."""
    args._check_choice("tokenizer_mode", TOKENIZER_MODES)
    json_object_flag(args.json_model_override_args, "--json-model-override-args")
    prefs = json_object_flag(args.preferred_sampling_params, "--preferred-sampling-params")
    unknown = sorted(set(prefs) - set(PREFERRED_SAMPLING_FIELDS))
    if unknown:
        raise ConfigError(f"--preferred-sampling-params: unknown field(s) {', '.join(unknown)}; "
                          f"known: {', '.join(PREFERRED_SAMPLING_FIELDS)}")
    if args.stream_interval < 1:
        raise ConfigError("--stream-interval must be >= 1 (tokens per streamed chunk)")
    if not 0 <= args.log_requests_level <= 3:
        raise ConfigError("--log-requests-level must be 0, 1, 2 or 3")
    if args.decode_log_interval < 1:
        raise ConfigError("--decode-log-interval must be >= 1 (decode steps between log lines)")
    if not 0 < args.schedule_conservativeness <= 100:
        raise ConfigError("--schedule-conservativeness must be in (0, 100] (1: SGLang's "
                          "default; larger keeps more KV pages back for running requests)")
    if bool(args.ssl_keyfile) != bool(args.ssl_certfile):
        raise ConfigError("HTTPS needs both --ssl-keyfile and --ssl-certfile (PEM files)")
    if args.enable_trace:
        from pdcore.edge.tracing import check_available

        check_available()
    if args.enable_torch_compile:
        raise ConfigError("--enable-torch-compile is refused: pdserve compiles no torch graphs "
                          "(SGLang uses it to capture CUDA graphs of small decode batches); on "
                          "CPU the decode loop already runs as native C++ kernels "
                          "(pdcore/engine/native); drop the flag")


COMMON_HELP: dict[str, str] = {
    "tokenizer_mode": "auto (the fast tokenizer when the model has one) or slow (the Python "
                      "tokenizer, use_fast=False)",
    "skip_tokenizer_init": "requests give input_ids and answers carry output_ids with empty "
                           "text (/generate); text prompts and the OpenAI routes answer 400",
    "json_model_override_args": "JSON object laid over the model's config.json before it "
                                "loads, e.g. '{\"max_position_embeddings\": 2048}'",
    "enable_mixed_chunk": "accepted: every step here already runs the decodes together with "
                          "the next prefill chunk",
    "stream_interval": "tokens per streamed chunk (the first token is sent at once)",
    "allow_auto_truncate": "a prompt of --context-length tokens or more is cut to its first "
                           "context-length - 1 tokens (logged) instead of answering 400",
    "enable_cache_report": "accepted: usage.prompt_tokens_details.cached_tokens (prompt "
                           "tokens taken from the prefix cache) is always reported",
    "preferred_sampling_params": "JSON object of sampling defaults for fields a request "
                                 "leaves out, e.g. '{\"temperature\": 0.6, \"top_p\": 0.9}'",
    "ssl_keyfile": "serve HTTPS with this PEM private key (with --ssl-certfile)",
    "ssl_certfile": "serve HTTPS with this PEM certificate chain (with --ssl-keyfile)",
    "log_requests_level": "with --log-requests: 0 counts and latency, 1 + sampling "
                          "parameters, 2 + the first 512 prompt and output token ids, 3 + all "
                          "of them",
    "decode_log_interval": "log one decode-batch line (running, queued, KV use, tokens/s) "
                           "every N decode steps",
    "enable_trace": "export an OpenTelemetry span tree per request to "
                    "--otlp-traces-endpoint (needs the `trace` extra: pip install "
                    "'pdcore[trace]')",
    "otlp_traces_endpoint": "OTLP/HTTP collector: HOST:PORT (spans go to "
                            "http://HOST:PORT/v1/traces) or a full URL",
    "crash_dump_folder": "when the engine dies, write the requests of its last 5 minutes "
                         "there as JSON (crash_dump_<time>.json)",
    "show_time_cost": "log each request's time to first token, decode time and tokens/s",
    "schedule_conservativeness": "1 (SGLang's default): admit new prompts while pages are "
                                 "free; C > 1 keeps (C - 1) x the running requests' remaining "
                                 "output pages back when admitting (capped at all of them)",
    "enable_torch_compile": "refused (exit 2): pdserve compiles no torch graphs; the CPU decode "
                            "loop runs native C++ kernels",
}


def config_file_argv(argv: list[str]) -> list[str]:
    """SGLang's --config FILE: a YAML (or JSON) mapping of flag names to values, made into
    flags placed before the command line's own (which win). ConfigError names what is
    wrong."""
    out, files, i = [], [], 0
    while i < len(argv):
        if argv[i] == "--config":
            if i + 1 >= len(argv):
                raise ConfigError("--config needs a file: --config FILE.yaml")
            files.append(argv[i + 1])
            i += 2
            continue
        if argv[i].startswith("--config="):
            files.append(argv[i].partition("=")[2])
        else:
            out.append(argv[i])
        i += 1
    head: list[str] = []
    for path in files:
        import yaml  # a dependency of transformers

        try:
            with open(os.path.expanduser(path), encoding="utf-8") as f:
                data = yaml.safe_load(f)
        except OSError as e:
            raise ConfigError(f"--config {path}: cannot read it ({e.strerror})") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"--config {path}: not valid YAML: {e}") from None
        if data is None:
            continue
        if not isinstance(data, dict):
            raise ConfigError(f"--config {path}: must hold a mapping of flag names to values "
                              "(e.g. `model-path: /models/x`), not a "
                              f"{type(data).__name__}")
        for key, value in data.items():
            flag = "--" + str(key).lstrip("-").replace("_", "-")
            if value is True:
                head.append(flag)
            elif value is False or value is None:
                continue
            elif isinstance(value, (dict, list)):
                head += [flag, json.dumps(value)] if isinstance(value, dict) else \
                    [flag, ",".join(str(v) for v in value)]
            else:
                head += [flag, str(value)]
    return head + out
