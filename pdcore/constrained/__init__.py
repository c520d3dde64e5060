"""Structured output, in two halves that live in different processes. `spec`: the fields of a
request that name a grammar, checked at the HTTP edge and turned into a `GrammarSpec` (pure
Python; the HTTP process imports only this). `backend`: xgrammar compiling a spec once (an LRU,
worker threads) into the per-request matcher whose token bitmask the sampler applies (the
scheduler process: the engine's sampler and `runtime/grammar_gate.py`)."""
