"""The types that cross processes, in one neutral package: the HTTP process and the scheduler
process exchange requests, outputs and control calls (`io`); servers and the router share the
machine-readable error codes of refusals (`codes`); a prefill instance publishes its facts to
decode servers on its bootstrap port (`bootstrap`); the router reads workers' loads and
KV-transfer totals (`stats`). It imports nothing of pdcore above the
standard library (tests/test_layers.py holds it), so every side can import it without the
engine, the server or the router."""
