"""PD router: picks a (prefill, decode) pair per request, adds the bootstrap fields, fans the
request out to both, merges the answers; health checks, retries, circuit breakers, policies.

Entry points: `pdcore.router.app.create_app(RouterConfig)`, `pdcore.router.cli.build_router_command`,
`python -m pdcore.router`. Nothing is imported here, so `import pdcore.router` stays cheap.
"""

from __future__ import annotations
