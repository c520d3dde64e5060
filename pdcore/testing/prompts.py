"""The prompt set every equivalence test uses: chat-templated and raw, about 5 to 600 tokens."""

from __future__ import annotations

_STORY = (
    "The lighthouse keeper had kept the lamp burning for forty years. Every night he climbed "
    "the spiral stairs, trimmed the wick, polished the great lens and watched the ships pass. "
)
_CODE = (
    "def merge_sort(items):\n    if len(items) <= 1:\n        return items\n    mid = len(items) // 2\n"
    "    left = merge_sort(items[:mid])\n    right = merge_sort(items[mid:])\n"
    "    return merge(left, right)\n\n"
)

RAW_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    _CODE + "def merge(left, right):",
    "Summarize the following story.\n\n" + _STORY * 17 + "\nSummary:",
]

CHAT_PROMPTS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "List three primary colors."}],
    [{"role": "user", "content": "Explain this code:\n" + _CODE * 4}],
]


def prompt_token_ids(tokenizer) -> list[list[int]]:
    """Token ids of the 8 prompts (raw ones plain, chat ones through the chat template)."""
    out = [tokenizer(p)["input_ids"] for p in RAW_PROMPTS]
    for msgs in CHAT_PROMPTS:
        ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        out.append(list(ids))
    return out
