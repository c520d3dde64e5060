"""Reusable test material for pdcore and its plugins (needs pytest).

Contract suites a plugin runs against itself by subclassing (see docs/plugin-hooks.md):
- `pdcore.testing.backend_contract`: BackendContract (two engines in one process) and
  CrossProcessBackendContract (receiver engine in a spawned child process);
- `pdcore.testing.pool_contract`: PoolContract;
- `pdcore.testing.platform_contract`: PlatformContract;
- `pdcore.testing.planner_contract`: PlannerContract.
Helpers: `pdcore.testing.copies` (random scattered copy plans), `pdcore.testing.remote`
(RemoteReceiver: a receiver engine in a child process).
"""
