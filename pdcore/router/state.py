"""What the router's routes share: its config, worker registry, policies, metrics and the
parts the lifespan starts (HTTP client, health monitor, proxy, service discovery, peering,
the other routers of a fleet)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdcore.router.metrics import RouterMetrics

if TYPE_CHECKING:
    import httpx

    from pdcore.router.config import RouterConfig
    from pdcore.router.discovery import ServiceDiscovery
    from pdcore.router.fleet import RouterFleet
    from pdcore.router.health import HealthMonitor
    from pdcore.router.peering import TrustSync
    from pdcore.router.policies import Policy
    from pdcore.router.proxy import Proxy
    from pdcore.router.workers import WorkerRegistry


@dataclass
class RouterState:
    config: RouterConfig
    registry: WorkerRegistry
    policies: dict[str, Policy]
    metrics: RouterMetrics = field(default_factory=RouterMetrics)
    client: httpx.AsyncClient | None = None
    monitor: HealthMonitor | None = None
    proxy: Proxy | None = None
    discovery: ServiceDiscovery | None = None
    peering: TrustSync | None = None
    fleet: RouterFleet | None = None  # --peer-routers
