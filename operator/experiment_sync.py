"""An experiment's glue for one service, at each reading of the control loop (control_loop.tick, inside the
service's reconcile): read what the lifecycle needs — the service's pods from the watch cache, the experiment's
windows from Prometheus — call the pure step (experiment/lifecycle.py), and carry out what it says through the
operator's fenced writes: the candidate's ConfigMap, the pods' variant labels, the promoted config, Events. What
goes into the CR (status.experiment) comes back for the runtime to patch with the rest of status.

Writes follow the cache, as the children's sync does: the candidate ConfigMap is written only when the cache does
not hold it as the step wants it (so one deleted by hand is put back), deleted only while the cache holds it, and
a pod is relabelled only when its cached labels differ. A service without an experiment, now or before, costs
nothing here: no request is made.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from metronome.contract.config import ServerConfigFile, validate_scheduler
from metronome.contract.rfc3339 import format_time, parse_time
from metronome.operator import builders, drift, kinds, reconcile
from metronome.operator.cache import ObjectCache
from metronome.operator.experiment import canary, children, lifecycle
from metronome.operator.experiment.queries import Windows
from metronome.operator.experiment.record import SPEC, Phase, Record, record_from_status
from metronome.operator.experiment.source import read_windows
from metronome.operator.k8s import Kube, KubeError
from metronome.operator.metrics_source import MetricsUnavailable, PrometheusSettings, ServiceSelector
from metronome.operator.spec import InferenceService
from metronome.operator.tuning.observation import Observation

log = logging.getLogger(__name__)

NOT_FOUND = 404
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


def _candidate_config(record: Record | None) -> ServerConfigFile | None:
    """What the candidate ConfigMap serves while the experiment has its slice (None: no ConfigMap wanted)."""
    if (record is None or record.phase not in (Phase.STARTING, Phase.RUNNING) or record.candidate is None
            or record.candidate_generation is None):
        return None
    scheduler = validate_scheduler(dict(record.candidate), source="status.experiment.candidate")
    return ServerConfigFile(generation=record.candidate_generation, scheduler=scheduler)


def _write_candidate_config(kube: Kube, cache: ObjectCache, service: InferenceService, record: Record,
                            config: ServerConfigFile) -> None:
    desired = drift.stamped(children.candidate_config_map(service, config, record.id))
    meta = desired["metadata"]
    if drift.needs_write(cache.get(kinds.CONFIG_MAP.kind, meta["namespace"], meta["name"]), desired):
        kube.apply(desired)


def _label(kube: Kube, cache: ObjectCache, namespace: str, pod: str, value: str) -> None:
    """Set one pod's variant label. A pod deleted since the watch last delivered it is no error: the next step
    sees it gone (a candidate pod lost aborts the experiment), and the rest of this step is still carried out."""
    try:
        kube.patch(kinds.POD.api_version, kinds.POD.kind, namespace, pod, children.label_patch(value))
    except KubeError as exc:
        if exc.status != NOT_FOUND:
            raise
        cache.forget(kinds.POD.kind, namespace, pod)
        log.info("%s/%s: pod gone before its variant label was set", namespace, pod)


def sync(kube: Kube, cache: ObjectCache, service: InferenceService, body: Mapping[str, Any],
         pods: Sequence[Mapping[str, Any]], served: ServerConfigFile | None, observation: Observation | None,
         prometheus: PrometheusSettings, url: str | None, now: float, record: Record | None = None,
         proposal: lifecycle.Wanted | None = None, configs: reconcile.ConfigMemory | None = None) -> ExperimentTick:
    """One step of the service's experiment (`pods`: the service's pods as cached; `record`: the one in status,
    unless the caller already stepped it; `proposal`: an autotune canary to start when nothing else runs)."""
    record = record if record is not None else current_record(body)
    wanted = wanted_now(service, record) or proposal
    if wanted is None and record is None:
        return ExperimentTick(None, served=served)
    names = builders.child_names(service.name)
    views = children.pod_views(pods)
    readings = problem = None
    if (record is not None and wanted is not None and record.id == wanted.id and record.phase is Phase.RUNNING
            and record.measuring_since is not None):
        readings, problem = _readings(prometheus, url, service, record, wanted, now)
    observed = lifecycle.Observed(
        replicas=service.spec.replicas, pods=views, served=served,
        pod_generations=dict(observation.pod_generations) if observation is not None else None,
        applied_at=dict(observation.config_applied_at) if observation is not None else {},
        readings=readings, readings_problem=problem)
    step = lifecycle.step(wanted, record, observed, now)

    candidate = step.candidate_config or _candidate_config(step.record)
    if candidate is not None:  # written at the start, and put back should it go missing or be edited
        _write_candidate_config(kube, cache, service, step.record, candidate)
    if step.control_config is not None:
        served = reconcile.write_config(kube, service, body, served, step.control_config,
                                        why=f"experiment {step.record.name or step.record.id} promoted",
                                        memory=configs)
    for pod, value in sorted(step.labels.items()):
        _label(kube, cache, service.namespace, pod, value)
    if step.delete_candidate_config and cache.get(kinds.CONFIG_MAP.kind, service.namespace,
                                                  names.candidate_config_map) is not None:
        kube.delete(kinds.CONFIG_MAP.api_version, kinds.CONFIG_MAP.kind, service.namespace,
                    names.candidate_config_map)
    for event in step.events:
        log.info("%s/%s: %s: %s", service.namespace, service.name, event.reason, event.message)
        kube.emit_event(body, event.type, event.reason, event.message)
    status = None
    if step.record is not None and step.record != record:
        status = status_patch(step.record, (body.get("status") or {}).get("experiment"))
    return ExperimentTick(step.record, status, step.pause_tuner, served)


def status_patch(record: Record, previous: Mapping[str, Any] | None) -> dict[str, Any]:
    """status.experiment as a merge patch over `previous`: a merge patch merges maps, so the fields of an earlier
    candidate that this one does not set are removed explicitly (None)."""
    status = record.to_status(format_time)
    earlier = (previous or {}).get("candidate") if isinstance(previous, Mapping) else None
    if isinstance(earlier, Mapping) and status.get("candidate") is not None:
        status["candidate"] = {**{key: None for key in earlier}, **status["candidate"]}
    return status
