"""`--tool-call-parser auto`: the parser whose format the model's chat template writes (the
template renders earlier tool calls, so it spells the family's markers), else the one of its
model family (config.json's model_type); None when neither tells."""

from __future__ import annotations

import functools

# (markers the template holds, all of them; parser), most specific first
_TEMPLATE_MARKS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("<tool_call>", "<function="), "qwen3_coder"),
    (("<tool_call>", "<arg_key>"), "glm45"),
    (("<|tool_calls_section_begin|>",), "kimi_k2"),
    (("<｜tool▁calls▁begin｜>", "```json"), "deepseekv3"),
    (("<｜tool▁calls▁begin｜>",), "deepseekv31"),
    (("to=functions.",), "gpt-oss"),
    (("<|channel|>",), "gpt-oss"),
    (("[TOOL_CALLS]",), "mistral"),
    (("<|python_start|>",), "pythonic"),
    (("<|python_tag|>",), "llama3"),
    (("<tool_call>",), "qwen25"),
)
_FAMILIES = {
    "qwen2": "qwen25", "qwen2_moe": "qwen25", "qwen3": "qwen25", "qwen3_moe": "qwen25",
    "llama": "llama3", "mistral": "mistral", "mixtral": "mistral", "deepseek_v3": "deepseekv3",
    "kimi_k2": "kimi_k2", "glm4_moe": "glm45", "gpt_oss": "gpt-oss",
}


@functools.lru_cache(maxsize=16)
def resolve(template: str | None, model_type: str | None) -> str | None:
    if isinstance(template, str):
        for marks, name in _TEMPLATE_MARKS:
            if all(m in template for m in marks):
                return name
    return _FAMILIES.get(model_type or "")
