"""Reconciliation steps, each a few API calls around the pure builders: write the children, serve a scheduler
config, observe what runs, read the service's metrics from Prometheus. The kopf handlers (handlers.py) call
these; the control loop reuses `write_config` to actuate and `observe` to read the children.

Each service's `ConfigMemory` keeps the server.yaml this process last wrote (configmap.Rendered), so reading the
ConfigMap back (every refresh) parses only what someone else wrote.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from metronome.contract.config import SchedulerConfig, ServerConfigFile, next_server_config
from metronome.operator import builders, changes, configmap, routing_sync
from metronome.operator.external_scalers import find_external_scalers
from metronome.operator.k8s import Kube
from metronome.operator.metrics_source import MetricsUnavailable, PrometheusSettings, ServiceSelector, try_observe
from metronome.operator.monitoring import MonitorSettings
from metronome.operator.spec import InferenceService
from metronome.operator.status import Observed
from metronome.operator.tuning.autotune import BAD_METRICS_SETTINGS
from metronome.operator.tuning.observation import Observation

log = logging.getLogger(__name__)


def _emit(kube: Kube, owner: Mapping[str, Any], event: changes.EventSpec | None) -> None:
    if event is not None:
        meta = owner["metadata"]
        log.info("%s/%s: %s: %s", meta.get("namespace"), meta.get("name"), event.reason, event.message)
        kube.emit_event(owner, event.type, event.reason, event.message)


@dataclass
class ConfigMemory:
    """The server.yaml this process last wrote for one service (None: nothing yet, or a restart)."""

    written: configmap.Rendered | None = None


def _read_config(kube: Kube, service: InferenceService,
                 memory: ConfigMemory | None) -> tuple[dict | None, ServerConfigFile | None, str | None]:
    existing = kube.get("v1", "ConfigMap", service.namespace, builders.child_names(service.name).config_map)
    config, error = configmap.safe_read_server_config(existing, memory.written if memory is not None else None)
    return existing, config, error


def _last_generation(existing: Mapping[str, Any] | None, owner: Mapping[str, Any]) -> int:
    """The highest generation ever written (ConfigMap annotation or status), so that a rewritten server.yaml
    continues the numbering and metronome_config_generation only moves forward."""
    annotations = ((existing or {}).get("metadata") or {}).get("annotations") or {}
    written = str(annotations.get(configmap.ANNOTATION_CONFIG_GENERATION, "0"))
    in_status = (owner.get("status") or {}).get("configGeneration") or 0
    return max(int(written) if written.isdigit() else 0, int(in_status))


def serve_scheduler(kube: Kube, service: InferenceService, owner: Mapping[str, Any], scheduler: SchedulerConfig,
                    why: str, memory: ConfigMemory | None = None) -> ServerConfigFile:
    """Make the ConfigMap serve `scheduler`: a new generation if it differs from what is served, else nothing."""
    existing, current, error = _read_config(kube, service, memory)
    if current is None:
        if error:
            _emit(kube, owner, changes.EventSpec(changes.WARNING, "InvalidConfig", f"{error}; rewriting it"))
        config = ServerConfigFile(generation=_last_generation(existing, owner) + 1, scheduler=scheduler)
    else:
        config = next_server_config(current, scheduler)
    return write_config(kube, service, owner, current, config, why, memory)


def write_config(kube: Kube, service: InferenceService, owner: Mapping[str, Any], before: ServerConfigFile | None,
                 config: ServerConfigFile, why: str, memory: ConfigMemory | None = None) -> ServerConfigFile:
    """Write `config` into the ConfigMap (`before`: what it served, for the Event) and keep its rendering."""
    rendered = configmap.render(config)
    kube.apply(builders.config_map(service, rendered))
    if memory is not None:
        memory.written = rendered
    _emit(kube, owner, changes.describe_config(before, config, why))
    return config


def sync_children(kube: Kube, service: InferenceService, owner: Mapping[str, Any],
                  monitor: MonitorSettings | None = MonitorSettings(),
                  memory: ConfigMemory | None = None) -> ServerConfigFile:
    """Create or repair every child. The ConfigMap keeps the config it serves (it may have been retuned); it is
    written from spec.server only when missing or invalid. `monitor` None leaves the PodMonitor as it is (a
    scale touches the Deployment only)."""
    service = keep_scaled_replicas(kube, service)
    _, current, _ = _read_config(kube, service, memory)
    if current is None:
        config = serve_scheduler(kube, service, owner, service.spec.server, why="from spec.server", memory=memory)
    else:
        config = write_config(kube, service, owner, current, current, why="", memory=memory)  # repairs labels/owner
    for child in builders.workload_children(service, monitoring_available=False):
        applied = kube.apply(child)
        _emit(kube, owner, changes.describe_child(applied.action.value, applied.before, applied.after))
    if not service.spec.disruption.enabled:
        remove_disruption_budget(kube, service, owner)
    routing_sync.sync_inference_pool(kube, service, owner)
    if monitor is not None:
        sync_pod_monitor(kube, service, owner, monitor)
    return config


def keep_scaled_replicas(kube: Kube, service: InferenceService) -> InferenceService:
    """While an HPA or a ScaledObject scales the Deployment itself, the Deployment keeps the count it set
    (spec.replicas would undo it at every write)."""
    if not find_external_scalers(kube, service).on_deployment:
        return service
    live = kube.get("apps/v1", "Deployment", service.namespace, builders.child_names(service.name).deployment)
    replicas = ((live or {}).get("spec") or {}).get("replicas")
    if not isinstance(replicas, int):
        return service
    return dataclasses.replace(service, spec=dataclasses.replace(service.spec, replicas=replicas))


def sync_pod_monitor(kube: Kube, service: InferenceService, owner: Mapping[str, Any], monitor: MonitorSettings) -> None:
    """The PodMonitor child per --monitor-kind, where the cluster serves that API: written with the monitor
    labels, or deleted when the kind is none (the chart's ServiceMonitor or annotations scrape the pods then, and
    a PodMonitor left behind would scrape every pod a second time)."""
    if not kube.crd_exists(builders.PODMONITOR_CRD):
        return
    if not monitor.pod_monitors:
        kube.delete(builders.PODMONITOR_API_VERSION, "PodMonitor", service.namespace,
                    builders.child_names(service.name).pod_monitor)
        return
    applied = kube.apply(builders.pod_monitor(service, dict(monitor.labels), monitor.interval_seconds))
    _emit(kube, owner, changes.describe_child(applied.action.value, applied.before, applied.after))


def remove_disruption_budget(kube: Kube, service: InferenceService, owner: Mapping[str, Any]) -> None:
    """spec.disruption.enabled false: the PodDisruptionBudget goes (garbage collection only follows the owner)."""
    name = builders.child_names(service.name).disruption_budget
    if kube.delete("policy/v1", "PodDisruptionBudget", service.namespace, name):
        _emit(kube, owner, changes.EventSpec(changes.NORMAL, "Deleted", f"deleted PodDisruptionBudget {name}"))


def observe(kube: Kube, service: InferenceService, memory: ConfigMemory | None = None) -> Observed:
    """Read the Deployment, the served config and, while pods are not all ready, the pods (for the reason)."""
    names = builders.child_names(service.name)
    deployment = kube.get("apps/v1", "Deployment", service.namespace, names.deployment)
    _, config, error = _read_config(kube, service, memory)
    ready = int(((deployment or {}).get("status") or {}).get("readyReplicas") or 0)
    pods: list[dict] = []
    if deployment is not None and ready < service.spec.replicas:
        pods = kube.list("v1", "Pod", service.namespace, builders.selector_string(service.name))
    return Observed(deployment=deployment, pods=tuple(pods), served_config=config, config_error=error,
                    scalers=find_external_scalers(kube, service))


def read_metrics(
    prometheus: PrometheusSettings, url: str, service: InferenceService, now: float
) -> tuple[Observation | None, MetricsUnavailable | None]:
    """One observation of the service from Prometheus at `url` (PrometheusSettings.resolve_url) over its
    spec.metrics window, or why there is none (never raises for Prometheus' sake: a sick Prometheus costs one
    interval, not the status refresh)."""
    try:
        window = prometheus.window(service.spec.metrics.window_seconds)
        source = prometheus.source_for(url)
    except ValueError as exc:  # a URL that is not http(s)://, a window shorter than its sub-window
        return None, MetricsUnavailable(BAD_METRICS_SETTINGS, str(exc))
    except MetricsUnavailable as exc:  # an unreadable token file
        return None, exc
    try:
        return try_observe(source, ServiceSelector(service.namespace, service.name), window, now)
    finally:
        source.close()
