"""The operator's run-time options (from `metronome operator` flags), shared by main.py and the handlers."""
from __future__ import annotations

from dataclasses import dataclass

DEFAULT_HEALTH_PORT = 8080
DEFAULT_STATUS_INTERVAL_SECONDS = 5.0


@dataclass(frozen=True)
class OperatorOptions:
    namespaces: tuple[str, ...] = ()  # empty = every namespace
    prometheus_url: str | None = None
    log_level: str = "INFO"
    health_host: str = "0.0.0.0"
    health_port: int = DEFAULT_HEALTH_PORT  # 0 = no liveness endpoint
    peering: str | None = None  # None = standalone (one operator replica)
    status_interval_seconds: float = DEFAULT_STATUS_INTERVAL_SECONDS

    @property
    def clusterwide(self) -> bool:
        return not self.namespaces

    @property
    def liveness_endpoint(self) -> str | None:
        if not self.health_port:
            return None
        return f"http://{self.health_host}:{self.health_port}/healthz"
