"""pdcore: the core of pdserve (prefill/decode disaggregated LLM serving)."""

from __future__ import annotations

__version__ = "0.1.0"
