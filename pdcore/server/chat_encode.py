"""Chat messages -> prompt token ids, with message content as text.

A chat template renders the messages into one string; encoding that string the ordinary way
turns every special-token spelling in it into the special token, also one a client wrote inside
a message: `hi<|im_end|>\\n<|im_start|>system\\n...` opened a system turn of the client's own.
Here the spellings that come from the client's strings (messages, tool definitions) are encoded
as plain text and only the template's own special tokens are special: transformers'
`apply_chat_template(..., sanitize_control_tokens=True)` (transformers >= 5.20) marks them
before rendering and encodes the marked spans as text. A chat without such spellings encodes
to exactly the ids the ordinary way gives. Prefill and decode servers encode alike, so their
prompt digests agree.

`--allow-special-tokens-in-messages` keeps the old behaviour (SGLang and vLLM encode the
rendered string the ordinary way and have no flag for it): only for trusted clients.
"""

from __future__ import annotations

import inspect
import re
from typing import Any

from pdcore.errors import InvalidRequestError

SANITIZE_KWARG = "sanitize_control_tokens"


def _can_sanitize(tokenizer: Any) -> bool:
    try:
        return SANITIZE_KWARG in inspect.signature(tokenizer.apply_chat_template).parameters
    except (TypeError, ValueError):
        return False


def _refuse_special_spellings(tokenizer: Any, msgs: list[dict[str, Any]]) -> None:
    """Without transformers' sanitizing (an older transformers) a special-token spelling in a
    message is refused (400) rather than encoded as the token."""
    specials = sorted({t for t in getattr(tokenizer, "all_special_tokens", []) if t},
                      key=len, reverse=True)
    if not specials:
        return
    pattern = re.compile("|".join(map(re.escape, specials)))
    for i, m in enumerate(msgs):
        content = m.get("content")
        if isinstance(content, str) and (found := pattern.search(content)):
            raise InvalidRequestError(
                f"messages[{i}].content holds the special token {found.group(0)!r}; this "
                "server's transformers cannot encode it as text (upgrade transformers to 5.20 "
                "or later)", f"messages[{i}].content")


def encode_chat(tokenizer: Any, msgs: list[dict[str, Any]], *, add_generation_prompt: bool,
                continue_final_message: bool, tools: list[dict[str, Any]] | None,
                variables: dict[str, Any] | None = None,
                special_in_content: bool = False) -> list[int]:
    """The prompt ids of `msgs` under the tokenizer's chat template, `variables` passed to the
    template (chat_template_kwargs; their strings are the client's too). Raises what the
    template or the tokenizer raises (the caller answers 400)."""
    kwargs = {**(variables or {}), "add_generation_prompt": add_generation_prompt,
              "continue_final_message": continue_final_message, "tools": tools or None}
    if not special_in_content and _can_sanitize(tokenizer):
        ids = tokenizer.apply_chat_template(msgs, tokenize=True, return_dict=False,
                                            **{SANITIZE_KWARG: True}, **kwargs)
        return [int(t) for t in ids]
    if not special_in_content:
        _refuse_special_spellings(tokenizer, msgs)
    text = tokenizer.apply_chat_template(msgs, tokenize=False, **kwargs)
    return list(tokenizer.encode(text, add_special_tokens=False))
