"""The control loop's body: one tick for one InferenceService, between the API and Prometheus.

runtime.Runtime.reconcile calls `tick` on every reconcile of a service. When a reading is due (every
spec.autotune.intervalSeconds, and at once after a spec change) it reads Prometheus (reconcile.read_metrics), takes
the experiment's step (experiment_sync: pauses the autotuner while one runs), runs the pure step
(tuning.autotune.step → tuning.actuation.tune; with autotune.canary a risky move becomes an experiment's candidate
instead) and carries the result out: the new server.yaml generation it rendered from the config observed this tick
(reconcile.write_config; nothing is read back), Events. What goes into the CR itself (spec.replicas, whose next
reconcile scales the Deployment, status.lastDecision and status.experiment) comes back in `Tick` for the runtime
to patch. One reading at a time per object (TunerMemory.lock).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from metronome.operator import experiment_sync, reconcile
from metronome.operator.cache import ObjectCache
from metronome.operator.experiment import canary
from metronome.operator.k8s import Kube
from metronome.operator.metrics_source import MetricsUnavailable, PrometheusSettings
from metronome.operator.spec import InferenceService
from metronome.operator.status import Observed, rollout_of
from metronome.operator.tuning import autotune
from metronome.operator.tuning.decision import Decision
from metronome.operator.tuning.settings import AutotuneMode

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Tick:
    observed: Observed  # what status is computed from, with the latest reading
    replicas: int | None = None  # patch spec.replicas to this
    last_decision: dict[str, Any] | None = None  # patch status.lastDecision to this
    decision: Decision | None = None  # what the loop decided this tick (None: no reading was due)
    experiment: dict[str, Any] | None = None  # patch status.experiment to this


def tick(kube: Kube, service: InferenceService, body: Mapping[str, Any], observed: Observed,
         memory: autotune.TunerMemory, prometheus: PrometheusSettings,
         configs: reconcile.ConfigMemory | None = None, cache: ObjectCache | None = None) -> Tick:
    """Read the metrics and act on them when due; otherwise status gets the last reading. `cache`: what the
    watches delivered (the experiment's candidate ConfigMap is looked up there; default: the one `kube` writes
    into)."""
    replicas = last_decision = decision = experiment = None
    cache = cache if cache is not None else kube.cache
    with memory.lock:
        now = time.time()
        if memory.due(now, service.generation):
            observation, unavailable = _read(prometheus, service, now)
            url = _url(prometheus, service)
            trial = experiment_sync.sync(kube, cache, service, body, observed.pods, observed.served_config,
                                         observation, prometheus, url, now, configs=configs)
            if trial.served is not observed.served_config:
                observed = dataclasses.replace(observed, served_config=trial.served, config_error=None)
            # The autotuner holds still while an experiment compares against the served config.
            tuned = service if not trial.pause_tuner else _paused(service)
            ready = rollout_of(observed.deployment, service.spec.replicas).ready if observed.deployment else 0
            owner = observed.scalers.owner if observed.scalers is not None else None
            result = autotune.step(tuned, observed.served_config, body.get("status") or {}, observation,
                                   unavailable, now, memory.last_change_time, ready_pods=ready,
                                   recent=memory.recommendations, replicas_owner=owner)
            result, proposal = _canary(service, observed, result, trial, now)
            experiment = trial.status
            if proposal is not None:
                trial = experiment_sync.sync(kube, cache, service, body, observed.pods, observed.served_config,
                                             observation, prometheus, url, now, record=trial.record,
                                             proposal=proposal, configs=configs)
                experiment = trial.status if trial.status is not None else experiment
            observed = _actuate(kube, service, body, observed, result, configs)
            replicas, last_decision, decision = result.replicas, result.last_decision, result.decision
            tuning = service.spec.autotune
            problem = memory.remember(result, now, service.generation, tuning.interval_seconds,
                                      tuning.scale_down_stabilization_seconds)
            if problem:
                kube.emit_event(body, "Warning", "AutotuneBlocked", problem)
    served_generation = observed.served_config.generation if observed.served_config is not None else None
    shown = experiment if experiment is not None else (body.get("status") or {}).get("experiment")
    observed = dataclasses.replace(observed, metrics=memory.metrics_for(served_generation),
                                   slo_override=memory.slo_override, experiment=shown)
    return Tick(observed, replicas, last_decision, decision, experiment)


def _paused(service: InferenceService) -> InferenceService:
    autotune_spec = dataclasses.replace(service.spec.autotune, mode=AutotuneMode.OFF)
    return dataclasses.replace(service, spec=dataclasses.replace(service.spec, autotune=autotune_spec))


def _canary(service: InferenceService, observed: Observed, result: autotune.TuneResult,
            trial: experiment_sync.ExperimentTick, now: float):
    """With spec.autotune.canary, a risky new config is not served: it becomes an experiment's candidate."""
    settings = service.spec.autotune
    served = observed.served_config
    if not settings.canary or result.config is None or served is None or service.spec.experiment is not None:
        return result, None
    why = canary.risk(served.scheduler, result.config.scheduler, settings.canary_chunk_change)
    if why is None:
        return result, None
    held = canary.held_off(trial.record, result.config.scheduler, now, settings.cooldown_seconds)
    record = dict(result.last_decision or {}, applied=False)
    if held is not None:
        record["reason"] = f"{record.get('reason', '')} (not tried: {held})"
        return dataclasses.replace(result, config=None, events=(), last_decision=record), None
    record["reason"] = f"{record.get('reason', '')} (canary: {why}; an experiment decides)"
    proposal = canary.canary_wanted(result.config.scheduler, service.spec.metrics.window_seconds, settings.min_samples)
    return dataclasses.replace(result, config=None, events=(), last_decision=record), proposal


def _url(prometheus: PrometheusSettings, service: InferenceService) -> str | None:
    try:
        return prometheus.resolve_url(service.spec.metrics.prometheus_url)
    except MetricsUnavailable:
        return None


def _read(prometheus: PrometheusSettings, service: InferenceService, now: float):
    """(observation, why not): nothing to read without a URL; a URL the allow-list refuses is never contacted."""
    try:
        url = prometheus.resolve_url(service.spec.metrics.prometheus_url)
    except MetricsUnavailable as refused:
        return None, refused
    return reconcile.read_metrics(prometheus, url, service, now) if url else (None, None)


def _actuate(kube: Kube, service: InferenceService, body: Mapping[str, Any], observed: Observed,
             result: autotune.TuneResult, configs: reconcile.ConfigMemory | None) -> Observed:
    if result.decision is not None and result.current is not None and (result.applied_change or result.last_decision):
        log.info("%s/%s: %s (%s): %s", service.namespace, service.name,
                 result.decision.describe_change(result.current), "applied" if result.applied_change else "advice",
                 result.decision.reason)
    if result.config is not None:
        config = reconcile.write_config(kube, service, body, observed.served_config, result.config,
                                        why=result.config_reason, memory=configs)
        observed = dataclasses.replace(observed, served_config=config, config_error=None)
    for event in result.events:
        kube.emit_event(body, event.type, event.reason, event.message)
    return observed
