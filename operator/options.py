"""The operator's run-time options (from `metronome operator` flags), shared by main.py and the handlers."""
from __future__ import annotations

from dataclasses import dataclass, field

from metronome.operator.alerts import RuleSettings
from metronome.operator.leader import LeaseTimes
from metronome.operator.metrics_source import PrometheusSettings
from metronome.operator.monitoring import MonitorSettings
from metronome.operator.spec import DEFAULT_IMAGE

DEFAULT_HEALTH_PORT = 8080
DEFAULT_STATUS_INTERVAL_SECONDS = 5.0
DEFAULT_LEASE_NAME = "metronome-operator"


@dataclass(frozen=True)
class LeaderElection:
    namespace: str
    name: str = DEFAULT_LEASE_NAME
    identity: str = ""
    times: LeaseTimes = field(default_factory=LeaseTimes)


@dataclass(frozen=True)
class OperatorOptions:
    namespaces: tuple[str, ...] = ()  # empty = every namespace
    prometheus: PrometheusSettings = field(default_factory=PrometheusSettings)
    monitor: MonitorSettings = field(default_factory=MonitorSettings)
    log_level: str = "INFO"
    health_host: str = "0.0.0.0"
    health_port: int = DEFAULT_HEALTH_PORT  # 0 = no liveness endpoint
    metrics_host: str = "0.0.0.0"
    metrics_port: int = 0  # the operator's own /metrics (operator_metrics.py); 0 = not served
    leader_election: LeaderElection | None = None  # None = this replica acts alone (one operator replica)
    # How often the operator-wide control loop looks for services whose Prometheus reading is due.
    status_interval_seconds: float = DEFAULT_STATUS_INTERVAL_SECONDS
    # The server image of InferenceServices without spec.image (--server-image).
    server_image: str = DEFAULT_IMAGE
    # --slo-alerts: a PrometheusRule with each service's SLO alerts (where the cluster serves that API).
    slo_rules: RuleSettings | None = None

    @property
    def prometheus_url(self) -> str | None:
        return self.prometheus.url

    @property
    def clusterwide(self) -> bool:
        return not self.namespaces

    @property
    def liveness_endpoint(self) -> str | None:
        if not self.health_port:
            return None
        return f"http://{self.health_host}:{self.health_port}/healthz"
