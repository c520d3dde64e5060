"""Scheduling: the Scheduler (`scheduler`: queues and pages; what runs, and what came out; the
step that runs it is pdcore.engine.loop), the batch runner (`batch_run`), its public surface
for role extensions (`api`, `extension`), the request (`request`), sampling with grammars and
speculative drafts (`sampler`, `grammar`, `speculative`), forks for n > 1 (`fork`), and what
a step hands back (`outputs`, `stats`)."""
