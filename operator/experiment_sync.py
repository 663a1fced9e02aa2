"""An experiment's glue for one service, at each reading of the control loop: read what the lifecycle needs (the
service's pods, the experiment's windows from Prometheus), call the pure step (experiment/lifecycle.py), and carry
out what it says — the candidate's ConfigMap, the pods' variant labels, the promoted config, Events. What goes
into the CR (status.experiment) comes back for the caller to patch, as the control loop's other results do.

A service without an experiment, now or before, costs nothing here: no request is made.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from metronome.contract.config import ServerConfigFile
from metronome.contract.rfc3339 import format_time, parse_time
from metronome.operator import builders, reconcile
from metronome.operator.experiment import canary, children, lifecycle
from metronome.operator.experiment.queries import Windows
from metronome.operator.experiment.record import SPEC, Phase, Record, record_from_status
from metronome.operator.experiment.source import read_windows
from metronome.operator.k8s import Kube
from metronome.operator.metrics_source import MetricsUnavailable, PrometheusSettings, ServiceSelector
from metronome.operator.spec import InferenceService
from metronome.operator.tuning.observation import Observation

log = logging.getLogger(__name__)

DEFAULT_LAG_S = 15.0  # a window's last scrapes are in after this long when the scrape interval is not known


@dataclass(frozen=True)
class ExperimentTick:
    record: Record | None  # the experiment after this step (None: none ever)
    status: dict[str, Any] | None = None  # write status.experiment (None: unchanged)
    pause_tuner: bool = False
    served: ServerConfigFile | None = None  # what server.yaml serves after the step (a promotion writes it)


def current_record(body: Mapping[str, Any]) -> Record | None:
    return record_from_status((body.get("status") or {}).get("experiment"), parse_time)


def wanted_now(service: InferenceService, record: Record | None) -> lifecycle.Wanted | None:
    """spec.experiment, else the autotune canary the record is running."""
    if service.spec.experiment is not None:
        return lifecycle.Wanted(service.spec.experiment, SPEC)
    return canary.running_canary(record, service.spec.metrics.window_seconds, service.spec.autotune.min_samples)


def lag_seconds(prometheus: PrometheusSettings, window_seconds: float) -> float:
    """How long after a window's end its last scrapes are surely in Prometheus."""
    if prometheus.scrape_interval_seconds:
        return 2.0 * prometheus.scrape_interval_seconds
    return min(DEFAULT_LAG_S, window_seconds / 4)


def _readings(prometheus: PrometheusSettings, url: str | None, service: InferenceService, record: Record,
              wanted: lifecycle.Wanted, now: float) -> tuple[list | None, str | None]:
    if url is None:
        return None, "no Prometheus URL"
    window = wanted.spec.window_seconds
    windows = Windows(record.measuring_since, window,
                      Windows.complete(record.measuring_since, window, now, lag_seconds(prometheus, window)))
    slo = service.spec.slo
    try:
        source = prometheus.source_for(url)
    except MetricsUnavailable as exc:
        return None, exc.message
    try:
        return read_windows(source, ServiceSelector(service.namespace, service.name), record.candidate_pods, windows,
                            slo.tbt_p99_ms / 1000.0 if slo is not None else None), None
    except MetricsUnavailable as exc:
        return None, exc.message
    finally:
        source.close()


def sync(kube: Kube, service: InferenceService, body: Mapping[str, Any], served: ServerConfigFile | None,
         observation: Observation | None, prometheus: PrometheusSettings, url: str | None, now: float,
         record: Record | None = None, proposal: lifecycle.Wanted | None = None,
         configs: reconcile.ConfigMemory | None = None) -> ExperimentTick:
    """One step of the service's experiment (`record`: the one in status, unless the caller already stepped it;
    `proposal`: an autotune canary to start when nothing else runs)."""
    record = record if record is not None else current_record(body)
    wanted = wanted_now(service, record) or proposal
    if wanted is None and record is None:
        return ExperimentTick(None, served=served)
    names = builders.child_names(service.name)
    pods = children.pod_views(kube.list("v1", "Pod", service.namespace, builders.selector_string(service.name)))
    readings = problem = None
    if (record is not None and wanted is not None and record.id == wanted.id and record.phase is Phase.RUNNING
            and record.measuring_since is not None):
        readings, problem = _readings(prometheus, url, service, record, wanted, now)
    observed = lifecycle.Observed(
        replicas=service.spec.replicas, pods=pods, served=served,
        pod_generations=dict(observation.pod_generations) if observation is not None else None,
        applied_at=dict(observation.config_applied_at) if observation is not None else {},
        readings=readings, readings_problem=problem)
    step = lifecycle.step(wanted, record, observed, now)

    if step.candidate_config is not None:
        kube.apply(children.candidate_config_map(service, step.candidate_config, step.record.id))
    if step.control_config is not None:
        served = reconcile.write_config(kube, service, body, served, step.control_config,
                                        why=f"experiment {step.record.name or step.record.id} promoted",
                                        memory=configs)
    for pod, value in sorted(step.labels.items()):
        kube.patch("v1", "Pod", service.namespace, pod, children.label_patch(value))
    if step.delete_candidate_config:
        kube.delete("v1", "ConfigMap", service.namespace, names.candidate_config_map)
    for event in step.events:
        log.info("%s/%s: %s: %s", service.namespace, service.name, event.reason, event.message)
        kube.emit_event(body, event.type, event.reason, event.message)
    status = None
    if step.record is not None and step.record != record:
        status = step.record.to_status(format_time)
    return ExperimentTick(step.record, status, step.pause_tuner, served)
