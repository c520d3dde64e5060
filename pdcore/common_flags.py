"""SGLang's common server flags (issue #45 item 12) as fields: `ServerArgs` (pdcore/config.py)
inherits them, so each is a `pdserve serve` flag. What each does here, its check and its help
live in pdcore/server/startup/sglang_flags.py."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CommonFlags:
    tokenizer_mode: str = "auto"  # auto: the fast tokenizer when the model has one; slow
    skip_tokenizer_init: bool = False  # input_ids in, output_ids out, no text
    json_model_override_args: str = "{}"  # JSON object laid over the model's config.json
    enable_mixed_chunk: bool = False  # prefill chunks always share a step with decodes here
    stream_interval: int = 1  # tokens per streamed chunk (the first token goes at once)
    allow_auto_truncate: bool = False  # a prompt too long is cut to fit instead of a 400
    enable_cache_report: bool = False  # usage.prompt_tokens_details.cached_tokens: always sent
    preferred_sampling_params: str | None = None  # JSON object: defaults for absent fields
    ssl_keyfile: str | None = None  # HTTPS: the server's private key (PEM)
    ssl_certfile: str | None = None  # HTTPS: its certificate chain (PEM)
    log_requests_level: int = 0  # with --log-requests: 0 counts, 1 + sampling, 2/3 + text
    decode_log_interval: int = 40  # a decode-batch log line every N decode steps
    enable_trace: bool = False  # OpenTelemetry spans per request (the `trace` extra)
    otlp_traces_endpoint: str = "localhost:4318"  # OTLP/HTTP collector HOST:PORT or URL
    crash_dump_folder: str | None = None  # the requests of the last 5 min, written at a crash
    show_time_cost: bool = False  # log each request's stage times (queue, prefill, decode)
    schedule_conservativeness: float = 1.0  # > 1: keep pages back for running decodes
    enable_torch_compile: bool = False  # refused: the CPU path runs native kernels
