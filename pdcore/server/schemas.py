"""Request bodies of the generate routes (pydantic).

Every model allows extra fields: SGLang clients and sglang-router add defaults we do not use
(`log_metrics`, `return_hidden_states`, `separate_reasoning`, ...) and they must not be rejected.
Ranges are checked in `pdcore.server.params`, so that errors name the field consistently.
"""

from __future__ import annotations

from typing import Any, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

BootstrapHost = Union[str, list[Union[str, None]], None]
BootstrapInt = Union[int, list[Union[int, None]], None]


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class PDFields(_Open):
    """Fields the PD router adds to every generate request (ignored in unified mode)."""

    bootstrap_host: BootstrapHost = None
    bootstrap_port: BootstrapInt = None
    bootstrap_room: BootstrapInt = None
    routed_dp_rank: Union[int, None] = None
    disagg_prefill_dp_rank: Union[int, None] = None
    data_parallel_rank: Union[int, None] = None
    rid: Union[str, list[str], None] = None


class SamplingParamsIn(_Open):
    @model_validator(mode="before")
    @classmethod
    def _none_means_default(cls, data: Any) -> Any:
        # clients serialise unset options as null; treat them as "use the default"
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data

    max_new_tokens: Union[int, None] = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: Union[int, None] = None
    sampling_seed: Union[int, None] = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: Union[list[int], None] = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1


class GenerateRequest(PDFields):
    text: Union[str, list[str], None] = None
    input_ids: Union[list[int], list[list[int]], None] = None
    sampling_params: Union[SamplingParamsIn, list[SamplingParamsIn], None] = None
    stream: bool = False
    return_logprob: Union[bool, list[bool]] = False
    logprob_start_len: Union[int, list[int]] = -1
    top_logprobs_num: Union[int, list[int]] = 0
    return_text_in_logprobs: bool = False
    timeout: Union[float, None] = Field(default=None, description="seconds; pdserve extension")


class StreamOptions(_Open):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _OpenAIBase(PDFields):
    model: Union[str, None] = None
    n: int = 1
    stream: bool = False
    stream_options: Union[StreamOptions, None] = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: Union[list[int], None] = None
    temperature: Union[float, None] = None
    top_p: Union[float, None] = None
    top_k: Union[int, None] = None
    min_p: Union[float, None] = None
    presence_penalty: Union[float, None] = None
    frequency_penalty: Union[float, None] = None
    repetition_penalty: Union[float, None] = None
    seed: Union[int, None] = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    user: Union[str, None] = None
    timeout: Union[float, None] = None


class CompletionRequest(_OpenAIBase):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Union[int, None] = 16
    logprobs: Union[int, None] = None
    echo: bool = False
    suffix: Union[str, None] = None


class ChatMessage(_Open):
    role: str
    content: Union[str, list[dict[str, Any]], None] = None


class ChatCompletionRequest(_OpenAIBase):
    messages: list[ChatMessage]
    max_tokens: Union[int, None] = None
    max_completion_tokens: Union[int, None] = None
    logprobs: bool = False
    top_logprobs: Union[int, None] = None
    continue_final_message: bool = False
