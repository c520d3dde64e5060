"""Tool calls and reasoning on the chat routes: the request side and the answer side
(`chat_tools`: `tools` / `tool_choice` checked, the forcing grammar, `ChoiceShaper` splitting a
choice into reasoning, content and calls), one parser per model family's call format
(`tool_parsers`; `auto` from the chat template: `tool_auto`) and reasoning format
(`reasoning`), all incremental readers over the growing output (`tool_scan`: linear, capped, no
backtracking regexes; `tool_stream`: a choice's calls as stream deltas)."""
