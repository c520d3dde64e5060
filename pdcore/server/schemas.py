"""Request bodies of the generate routes (pydantic).

Every model allows extra fields: SGLang clients and sglang-router add defaults we do not use
(`log_metrics`, `return_hidden_states`, `separate_reasoning`, ...) and they must not be rejected.
Ranges are checked in `pdcore.server.params`, so that errors name the field consistently.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

BootstrapHost = str | list[str | None] | None
BootstrapInt = int | list[int | None] | None


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class PDFields(_Open):
    """Fields the PD router adds to every generate request (ignored in unified mode)."""

    bootstrap_host: BootstrapHost = None
    bootstrap_port: BootstrapInt = None
    bootstrap_room: BootstrapInt = None
    bootstrap_sig: BootstrapHost = None  # the router's signature of the route (route_auth)
    routed_dp_rank: int | None = None
    disagg_prefill_dp_rank: int | None = None
    data_parallel_rank: int | None = None
    rid: str | list[str] | None = None


class SamplingParamsIn(_Open):
    @model_validator(mode="before")
    @classmethod
    def _none_means_default(cls, data: Any) -> Any:
        # clients serialise unset options as null; treat them as "use the default"
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data

    max_new_tokens: int | None = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    sampling_seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1


class GenerateRequest(PDFields):
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SamplingParamsIn | list[SamplingParamsIn] | None = None
    stream: bool = False
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] = -1
    top_logprobs_num: int | list[int] = 0
    return_text_in_logprobs: bool = False
    timeout: float | None = Field(default=None, description="seconds; pdserve extension")


class StreamOptions(_Open):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _OpenAIBase(PDFields):
    model: str | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    user: str | None = None
    timeout: float | None = None


class CompletionRequest(_OpenAIBase):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None


# "developer" is OpenAI's newer name for "system"; "tool" / "function" messages need tools,
# which are not implemented (README, "No silent no-ops")
ChatRole = Literal["system", "user", "assistant", "developer"]


class ChatMessage(_Open):
    role: ChatRole
    content: str | list[dict[str, Any]] | None = None

    @field_validator("role")
    @classmethod
    def _developer_is_system(cls, role: str) -> str:
        return "system" if role == "developer" else role


class ChatCompletionRequest(_OpenAIBase):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    continue_final_message: bool = False
