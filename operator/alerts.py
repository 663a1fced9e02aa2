"""Pure: a service's own SLO alerts, as a prometheus-operator PrometheusRule the operator writes beside the
service (one per InferenceService with a `spec.slo`, owned by it, labelled like the monitors so that the same
Prometheus selects it). Each alert holds that service's target: TBT p99 above `slo.tbtP99Ms`, TTFT p99 above
`slo.ttftP99Ms`, output tokens per second below `slo.minThroughputTokensPerSecond` (the two last only when set),
for `for_minutes`. The series are selected as the operator's own queries select them (metrics_source.
ServiceSelector: `namespace` and the server's `model` label), over the metric names of metronome.contract.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from metronome.contract import metric_names as names
from metronome.operator.metrics_source import ServiceSelector
from metronome.operator.spec import InferenceService

RULE_API_VERSION = "monitoring.coreos.com/v1"
GROUP_PREFIX = "metronome-slo"
RATE_WINDOW = "5m"


@dataclass(frozen=True)
class RuleSettings:
    """--slo-alerts: write a PrometheusRule per service with an SLO, with these labels (the monitors')."""

    labels: tuple[tuple[str, str], ...] = ()
    for_minutes: int = 10

    def __post_init__(self) -> None:
        if self.for_minutes < 1:
            raise ValueError(f"--slo-alert-for must be at least 1 minute, got {self.for_minutes}")


def _alert(name: str, expr: str, service: InferenceService, minutes: int, summary: str, description: str):
    return {
        "alert": name,
        "expr": expr,
        "for": f"{minutes}m",
        "labels": {"severity": "warning", "namespace": service.namespace, "inferenceservice": service.name},
        "annotations": {"summary": summary, "description": description},
    }


def slo_alerts(service: InferenceService, minutes: int) -> list[dict[str, Any]]:
    """The alert rules for `service`'s SLO (none without one)."""
    slo = service.spec.slo
    if slo is None:
        return []
    m = ServiceSelector(service.namespace, service.name).matchers()
    who = f"InferenceService {service.namespace}/{service.name}"
    value = '{{ $value | printf "%.1f" }}'
    rules = [_alert(
        "MetronomeTBTSLOViolated",
        f"histogram_quantile(0.99, sum by (le) (rate({names.TIME_BETWEEN_TOKENS}_bucket{m}[{RATE_WINDOW}])))"
        f" * 1000 > {slo.tbt_p99_ms:g}",
        service, minutes, f"p99 TBT of {who} above its SLO of {slo.tbt_p99_ms:g} ms",
        f"p99 time between tokens has been {value} ms for {minutes} minutes (spec.slo.tbtP99Ms "
        f"{slo.tbt_p99_ms:g}). See the resource's SLOMet condition and Events.")]
    if slo.ttft_p99_ms is not None:
        rules.append(_alert(
            "MetronomeTTFTSLOViolated",
            f"histogram_quantile(0.99, sum by (le) (rate({names.TIME_TO_FIRST_TOKEN}_bucket{m}[{RATE_WINDOW}])))"
            f" * 1000 > {slo.ttft_p99_ms:g}",
            service, minutes, f"p99 TTFT of {who} above its SLO of {slo.ttft_p99_ms:g} ms",
            f"p99 time to first token has been {value} ms for {minutes} minutes (spec.slo.ttftP99Ms "
            f"{slo.ttft_p99_ms:g})."))
    floor = slo.min_throughput_tokens_per_second
    if floor is not None:
        rules.append(_alert(
            "MetronomeThroughputBelowSLO",
            f"sum(rate({names.GENERATION_TOKENS}{m}[{RATE_WINDOW}])) < {floor:g}",
            service, minutes, f"output tokens per second of {who} below its SLO of {floor:g}",
            f"the service has produced {value} tokens/s for {minutes} minutes (spec.slo."
            f"minThroughputTokensPerSecond {floor:g})."))
    return rules


def prometheus_rule(service: InferenceService, settings: RuleSettings,
                    metadata: Mapping[str, Any]) -> dict[str, Any] | None:
    """The PrometheusRule of `service` (None without an SLO); `metadata`: its name, namespace, owner, labels."""
    rules = slo_alerts(service, settings.for_minutes)
    if not rules:
        return None
    meta = dict(metadata)
    meta["labels"] = {**dict(settings.labels), **(meta.get("labels") or {})}
    return {
        "apiVersion": RULE_API_VERSION,
        "kind": "PrometheusRule",
        "metadata": meta,
        "spec": {"groups": [{"name": f"{GROUP_PREFIX}.{service.namespace}.{service.name}", "rules": rules}]},
    }
