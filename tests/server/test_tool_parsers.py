"""Every output parser (tool calls, reasoning) in linear time with a size cap (#44 item 5): the
worst inputs a client can make a model write (an open marker and a megabyte of spaces, markers
repeated, brackets nested 100,000 deep) parse within a generous liveness bound, answer content
and never raise."""

from __future__ import annotations

import time

import pytest

from pdcore.server import reasoning, tool_parsers

MEGA = 1 << 20


def _worst(start: str) -> list[str]:
    return [start + " " * MEGA, start * (MEGA // max(len(start), 1)), start + "[" * 100_000,
            start + "{" * 100_000 + "}" * 100_000, start + '"\\' * (MEGA // 2),
            start + '{"name": "f", "arguments": ' + "[" * 50_000 + "]" * 50_000 + "}",
            (start + '{"name": "f", "arguments": {}}\n') * 20_000]


@pytest.mark.parametrize("name", sorted(tool_parsers.PARSERS))
def test_tool_parsers_are_linear_and_capped(name: str) -> None:
    p = tool_parsers.get_parser(name)
    for text in _worst(p.start) + _worst("<tool_call>"):
        t = time.monotonic()
        content, calls = p.parse(text, {"f"})
        p.hold_from(text)
        assert time.monotonic() - t < 1.0, (name, text[:40], len(text))
        assert isinstance(content, str) and isinstance(calls, list)


@pytest.mark.parametrize("name", sorted(reasoning.PARSERS))
def test_reasoning_parsers_are_linear(name: str) -> None:
    p = reasoning.PARSERS[name]()
    for text in _worst("<think>") + _worst("</think>"):
        t = time.monotonic()
        for done in (False, True):
            r, c = p.split(text, done)
            assert isinstance(r, str) and isinstance(c, str)
        assert time.monotonic() - t < 1.0, (name, text[:40], len(text))
