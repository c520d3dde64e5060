"""What a started engine tells the HTTP process about itself (`EngineInfo`): the scheduler
process builds it (engine/build.py, the role extension adds its part), sends it once when it is
ready, and the HTTP process reads its fields (the prompt checks, /server_info, /v1/models, the
OpenAI routes' defaults). /server_info serves it as JSON (`as_dict`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass
class EngineInfo:
    """Every field has an empty default: an engine that does not know a value leaves it, and a
    reader treats 0 / "" / None as "unknown" (the router, which has no engine, checks with an
    empty one)."""

    model_path: str = ""
    tokenizer_path: str = ""  # the HTTP process sets the folder it loaded the tokenizer from
    served_model_name: str = ""
    context_length: int = 0  # prompt + output tokens a request may hold
    max_total_tokens: int = 0  # tokens the KV pool holds
    page_size: int = 0
    num_pages: int = 0
    vocab_size: int = 0
    eos_token_ids: list[int] = field(default_factory=list)
    dtype: str = ""  # the model's ("float32", "bfloat16", ...)
    kv_cache_dtype: str = ""
    load_format: str = ""
    random_seed: int | None = None
    device: str = ""
    architectures: list[str] = field(default_factory=list)
    model_type: str = ""
    disaggregation_mode: str = "null"
    tp_size: int = 1
    dp_size: int = 1
    nnodes: int = 1
    bootstrap_port: int | None = None
    memory_pool: str = ""  # the KV pool's memory pool plugin
    is_mla: bool = False
    kv_bytes_per_token: int = 0
    weight_bytes: int = 0
    # the model's generation_config.json sampling values (--sampling-defaults model), else {}
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    # the role extension's part (PD servers)
    disaggregation_transfer_backend: str | None = None
    bootstrap_addr: str | None = None
    # the HTTP process's part: where the scheduler's threads run (CPU placement)
    cpu_placement: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """The JSON /server_info serves (every field by its name)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> EngineInfo:
        """From a dict of field names (a test's stand-in scheduler sends one); names that are
        no field are refused (TypeError), so a misspelt key cannot go unnoticed."""
        return cls(**values)
