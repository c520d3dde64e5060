"""Scheduling: the Scheduler (`scheduler`: schedule -> run -> postprocess), its public surface
for role extensions (`api`, `extension`), the request (`request`), sampling with grammars and
speculative drafts (`sampler`, `grammar`, `speculative`), forks for n > 1 (`fork`), and what
a step hands back (`outputs`, `stats`)."""
