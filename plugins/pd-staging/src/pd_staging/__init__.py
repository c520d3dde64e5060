"""pd-staging: a pdcore transfer planner that moves KV between different TP sizes through
staging memory (prefill per-worker buffers, a decode ring pool)."""

__version__ = "0.1.0"
