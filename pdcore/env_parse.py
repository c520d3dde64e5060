"""Parsers of environment variable values, for the declarations in pdcore.env.

Each parser takes (variable name, raw value) and returns the value, or raises `EnvError` naming
the variable and what to give instead. They read nothing themselves: pdcore.env is the only
reader of the environment.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from pdcore.errors import ConfigError

T = TypeVar("T")
Parser = Callable[[str, str], T]  # (variable name, raw value) -> value; EnvError when bad


class EnvError(ConfigError, ValueError):
    """A variable's value cannot be used; the message names the variable and what to give."""


# ---- parsers ------------------------------------------------------------------------------------
def text(name: str, raw: str) -> str:
    return raw.strip()


def verbatim(name: str, raw: str) -> str:
    return raw


def lowered(name: str, raw: str) -> str:
    return raw.strip().lower()


def flag(name: str, raw: str) -> bool:
    """1/true/yes/on: True; any other value: False (as SGLang reads its switches)."""
    return raw.strip().lower() in ("1", "true", "yes", "on")


def not_zero(name: str, raw: str) -> bool:
    """On unless exactly `0`."""
    return raw != "0"


def number(name: str, raw: str) -> float:
    try:
        return float(raw)
    except ValueError:
        raise EnvError(f"{name} must be a number, got {raw!r}") from None


def integer(name: str, raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise EnvError(f"{name} must be an integer, got {raw!r}") from None


def positive(what: str = "a number > 0") -> Parser[float]:
    def parse(name: str, raw: str) -> float:
        try:
            value = float(raw.strip())
        except ValueError:
            value = -1.0
        if not value > 0:  # also NaN
            raise EnvError(f"{name}={raw.strip()!r}: give {what}")
        return value
    return parse


def count(low: int, what: str) -> Parser[int]:
    """A whole number >= low (digits only)."""
    def parse(name: str, raw: str) -> int:
        raw = raw.strip()
        if not raw.isdigit() or int(raw) < low:
            raise EnvError(f"{name}={raw!r}: give {what} >= {low}")
        return int(raw)
    return parse


def choice(*options: str, listing: str = "") -> Parser[str]:
    """One of `options` (case-insensitive); `listing` is how the message names them."""
    def parse(name: str, raw: str) -> str:
        value = raw.strip().lower()
        if value not in options:
            raise EnvError(f"{name} must be one of {listing or ', '.join(options)}; got {value!r}")
        return value
    return parse
