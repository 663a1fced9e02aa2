"""The operator's own Prometheus series (names: metronome.contract.metric_names, OPERATOR_*), served on
`--metrics-port` for dashboards: the control loop's decisions by action (the Grafana dashboard draws them as
annotations), each service's SLO targets (drawn next to the servers' p99s), and the replicas its last reading
says the service needs (what an HPA or KEDA can drive it by instead of the loop).

`OperatorMetrics` holds one registry; the runtime calls `after_tick` on every reconcile of a service (its SLO
targets, and the loop's decision when a reading was due) and `forget` when it is deleted. Serving is
prometheus_client's own HTTP server on a daemon thread.
"""
from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from metronome.contract import metric_names as names
from metronome.operator.spec import InferenceService
from metronome.operator.tuning.decision import Decision

SERVICE_LABELS = [names.SERVICE_NAMESPACE_LABEL, names.SERVICE_LABEL]


class OperatorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        self.decisions = Counter(names.OPERATOR_DECISIONS, "Decisions of the control loop, by action, applied or "
                                 "only advised.", SERVICE_LABELS + [names.DECISION_ACTION_LABEL,
                                                                    names.DECISION_APPLIED_LABEL],
                                 registry=self.registry)
        self.slo_target = Gauge(names.OPERATOR_SLO_TARGET, "The service's SLO target, by objective.",
                                SERVICE_LABELS + [names.SLO_OBJECTIVE_LABEL], registry=self.registry)
        self.desired_replicas = Gauge(names.OPERATOR_DESIRED_REPLICAS, "The replicas the control loop's last "
                                      "reading says the offered load needs, within the service's bounds.",
                                      SERVICE_LABELS, registry=self.registry)
        self._lock = threading.Lock()
        self._actions: dict[tuple[str, str], set[tuple[str, str]]] = {}

    def after_tick(self, service: InferenceService, decision: Decision | None) -> None:
        """One refresh of `service`: its SLO targets as the spec says now, and the loop's decision if it took one
        (applied unless autotune only advises)."""
        slo = service.spec.slo
        self.describe_service(service.namespace, service.name, {
            "tbt_p99": slo.tbt_p99_ms / 1000.0 if slo is not None else None,
            "ttft_p99": slo.ttft_p99_ms / 1000.0 if slo is not None and slo.ttft_p99_ms is not None else None,
        })
        if decision is not None:
            self.record(service.namespace, service.name, tuple(action.value for action in decision.actions),
                        applied=not decision.advisory)
        if decision is not None and decision.recommended_replicas is not None:
            self.desired_replicas.labels(service.namespace, service.name).set(decision.recommended_replicas)

    def record(self, namespace: str, name: str, actions: tuple[str, ...], applied: bool) -> None:
        """One decision of the loop for one service: each of its actions counted once."""
        flag = "true" if applied else "false"
        with self._lock:
            seen = self._actions.setdefault((namespace, name), set())
            for action in dict.fromkeys(actions):
                self.decisions.labels(namespace, name, action, flag).inc()
                seen.add((action, flag))

    def describe_service(self, namespace: str, name: str, targets_s: dict[str, float | None]) -> None:
        """The service's SLO targets in seconds by objective (names.SLO_OBJECTIVES); None removes one."""
        for objective in names.SLO_OBJECTIVES:
            value = targets_s.get(objective)
            if value is None:
                try:
                    self.slo_target.remove(namespace, name, objective)
                except KeyError:
                    pass
            else:
                self.slo_target.labels(namespace, name, objective).set(value)

    def forget(self, namespace: str, name: str) -> None:
        """A deleted service's series go (a re-created one starts its counters at zero)."""
        self.describe_service(namespace, name, {})
        with self._lock:
            seen = self._actions.pop((namespace, name), set())
        for action, flag in seen:
            self.decisions.remove(namespace, name, action, flag)
        try:
            self.desired_replicas.remove(namespace, name)
        except KeyError:
            pass

    def serve(self, host: str, port: int):
        """Serve GET /metrics on host:port (a daemon thread); returns the server, whose shutdown() stops it."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return server
