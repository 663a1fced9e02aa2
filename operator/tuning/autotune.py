"""The autotune step of one InferenceService: a metrics reading → what status shows and what to actuate.

Pure: `step(...)` takes the parsed service, the served config, the CR's status and the reading (an Observation,
or why there is none), runs the one tuning step (actuation.tune) and returns a `TuneResult`. control_loop.tick
reads Prometheus, calls `step` and carries the result out: a new server.yaml generation is written as given
(reconcile.write_config, with a ConfigUpdated Event naming the reason), a replica change becomes a patch of
spec.replicas, lastDecision and Events are written as given. `TunerMemory` is the little state kept per object
between readings.

Rules:
- no reading (Prometheus down, no series, no URL) or too few TBT samples → change nothing; MetricsAvailable=False
  with the reason (the condition's transition is the Event, so it is posted once, not every interval);
- mode off → metrics for status only; advise → decide, record the proposal in lastDecision (applied=false) and
  an "Advice" Event when it is new; apply → decide and act, with a PolicySwitched Event whenever the queue policy
  changes; a decision that cannot help (chunk at its floor, no replicas to add) turns SLOMet's reason into
  ChunkAtFloor;
- lastDecision's chunk sizes are prefill budgets (metronome.contract.budget): what the servers enforce before
  the decision and after it is laid out, the numbers status.chunkSize and the metronome_chunk_size gauge show;
- the time of the last applied change comes from status.lastDecision, so cooldowns survive operator restarts.
"""
from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from metronome.contract.budget import prefill_budget
from metronome.contract.config import ConfigError, ServerConfigFile
from metronome.contract.rfc3339 import format_time, parse_time
from metronome.operator.changes import NORMAL, EventSpec
from metronome.operator.spec_error import SpecError
from metronome.operator.tuning.actuation import Tuned, scheduler_for, tune
from metronome.operator.tuning.decision import CurrentConfig, Decision
from metronome.operator.tuning.observation import MetricsUnavailable, Observation
from metronome.operator.tuning.replicas import Recommendation, prune
from metronome.operator.tuning.settings import AutotuneMode, AutotuneSpec

if TYPE_CHECKING:
    from metronome.operator.spec import InferenceService

MIN_SAMPLES = AutotuneSpec.min_samples  # fewer TBT samples in the window = no data (the controller's own rule)

METRICS_READ = "MetricsRead"
NO_SAMPLES = "NoSamples"
AWAITING_PODS = "AwaitingPods"
NOT_CONFIGURED = "PrometheusNotConfigured"
BAD_METRICS_SETTINGS = "InvalidMetricsSettings"
CHUNK_AT_FLOOR = "ChunkAtFloor"
ADVICE = "Advice"
SCALED = "AutotuneScaled"
POLICY_SWITCHED = "PolicySwitched"


@dataclass(frozen=True)
class ServingMetrics:
    """What the metrics source saw for one service over its window (filled in by the control loop)."""

    available: bool
    reason: str = "MetricsRead"
    message: str = ""
    tbt_p99_ms: float | None = None
    ttft_p99_ms: float | None = None
    throughput_tokens_per_second: float | None = None
    pods_on_generation: int | None = None


@dataclass(frozen=True)
class TuneResult:
    """What one reading leads to. Fields left at None/empty mean "nothing to do"."""

    metrics: ServingMetrics
    pod_generations: Mapping[str, int] | None = None  # config generation per pod; None = Prometheus did not answer
    decision: Decision | None = None
    current: CurrentConfig | None = None
    config: ServerConfigFile | None = None  # serve this next: a new server.yaml generation
    replicas: int | None = None  # patch spec.replicas to this
    last_decision: dict[str, Any] | None = None  # write status.lastDecision
    events: tuple[EventSpec, ...] = ()
    slo_override: tuple[str, str] | None = None  # SLOMet (reason, why) while the violation cannot be fixed
    problem: str | None = None  # why autotune cannot run at all (bad spec, no Prometheus); None = fine

    @property
    def config_reason(self) -> str:
        """The `why` of the ConfigUpdated Event."""
        return f"autotune: {self.decision.reason}" if self.decision is not None else "autotune"

    @property
    def scheduler(self):
        """The scheduler of the config to serve next (None: nothing new to serve)."""
        return self.config.scheduler if self.config is not None else None

    @property
    def applied_change(self) -> bool:
        return self.config is not None or self.replicas is not None


# --- status fields from a reading ----------------------------------------------------------------------------


def serving_metrics(observation: Observation | None, unavailable: MetricsUnavailable | None,
                    served_generation: int | None, min_samples: int = MIN_SAMPLES,
                    ready_pods: int | None = None) -> ServingMetrics:
    """MetricsAvailable and the measured status fields. Pods on the generation are counted whenever Prometheus
    answered (generations need no traffic); TBT, TTFT and throughput only with enough TBT samples. No series
    while no pod is ready is expected (a new service), not a scrape problem."""
    if unavailable is not None and unavailable.reason == MetricsUnavailable.NO_SERIES and ready_pods == 0:
        return ServingMetrics(available=False, reason=AWAITING_PODS,
                              message="no server pod is ready yet, so Prometheus has nothing to scrape")
    if unavailable is not None:
        return ServingMetrics(available=False, reason=unavailable.reason, message=unavailable.message)
    if observation is None:
        return ServingMetrics(available=False, reason=NOT_CONFIGURED, message=(
            "no Prometheus URL: set spec.metrics.prometheusUrl or the operator's --prometheus-url"))
    on_generation = pods_on_generation(observation.pod_generations, served_generation)
    window = f"{observation.window_seconds:.0f} s window"
    if observation.tbt_p99_s is None or observation.sample_count < min_samples:
        return ServingMetrics(available=False, reason=NO_SAMPLES, pods_on_generation=on_generation, message=(
            f"fewer than {min_samples} TBT samples in the {window} (no traffic?): nothing to judge or tune by"))
    return ServingMetrics(
        available=True, reason=METRICS_READ, message=f"read from Prometheus over a {window}",
        tbt_p99_ms=observation.tbt_p99_s * 1000.0,
        ttft_p99_ms=observation.ttft_p99_s * 1000.0 if observation.ttft_p99_s is not None else None,
        throughput_tokens_per_second=observation.output_tokens_per_s,
        pods_on_generation=on_generation,
    )


def pods_on_generation(pod_generations: Mapping[str, int] | None, generation: int | None) -> int | None:
    """Pods whose metronome_config_generation is exactly the served generation (None = not known)."""
    if pod_generations is None or generation is None:
        return None
    return sum(1 for g in pod_generations.values() if g == generation)


# --- times ---------------------------------------------------------------------------------------------------


def last_change_time(status: Mapping[str, Any] | None) -> float | None:
    """When the controller last acted, from status.lastDecision (advice does not count: nothing changed)."""
    record = (status or {}).get("lastDecision") or {}
    if not isinstance(record, Mapping) or record.get("applied") is not True:
        return None
    return parse_time(record.get("time"))


def _latest(*times: float | None) -> float | None:
    known = [t for t in times if t is not None]
    return max(known) if known else None


# --- the step ------------------------------------------------------------------------------------------------


def step(
    service: InferenceService,
    served: ServerConfigFile | None,
    status: Mapping[str, Any] | None,
    observation: Observation | None,
    unavailable: MetricsUnavailable | None,
    now: float,
    remembered_change_time: float | None = None,
    ready_pods: int | None = None,
    recent: Sequence[Recommendation] = (),
    replicas_owner: str | None = None,
) -> TuneResult:
    """One reading of one service. `remembered_change_time` is this process's own record of its last change
    (status may lag a tick behind the patch that wrote it); the later of the two counts. `ready_pods`: the
    Deployment's ready replicas (None = unknown). `recent`: the replica recommendations of this process's earlier
    readings (TunerMemory). `replicas_owner`: the HPA or ScaledObject that sets the replicas (the loop then
    leaves them alone)."""
    metrics = serving_metrics(observation, unavailable, served.generation if served is not None else None,
                              ready_pods=ready_pods)
    reading = TuneResult(metrics, dict(observation.pod_generations) if observation is not None else None)
    spec = service.spec.autotune
    if spec.mode is AutotuneMode.OFF:
        return reading
    if unavailable is None and observation is None:
        return replace(reading, problem=f"autotune is {spec.mode.value} but {metrics.message}")
    if served is None:
        return reading  # nothing served to tune from; ConfigApplied says why

    try:
        tuned = tune(observation if unavailable is None else None, served, service.spec.replicas, spec, now,
                     _latest(last_change_time(status), remembered_change_time), recent, replicas_owner)
    except SpecError as exc:
        return replace(reading, problem=f"autotune is {spec.mode.value} but cannot run: {exc}")
    decision, current = tuned.decision, tuned.current
    slo_override = (CHUNK_AT_FLOOR, decision.reason) if decision.slo_unreachable else None
    result = replace(reading, decision=decision, current=current, slo_override=slo_override)
    if decision.changed:
        return _apply(result, tuned, spec, now)
    if decision.advisory and decision.proposed_change:
        return _advise(result, decision, current, served, status, now)
    return result


def decision_record(
    *,
    time: str,
    before: tuple[int, str, int],
    after: tuple[int, str, int],
    reason: str,
    policy: str,
    applied: bool,
) -> dict[str, Any]:
    """status.lastDecision as the CRD defines it; `before`/`after` are (chunkSize, queuePolicy, replicas)."""

    def settings(values: tuple[int, str, int]) -> dict[str, Any]:
        chunk_size, queue_policy, replicas = values
        return {"chunkSize": int(chunk_size), "queuePolicy": str(queue_policy), "replicas": int(replicas)}

    return {
        "time": time,
        "from": settings(before),
        "to": settings(after),
        "reason": reason,
        "policy": policy,
        "applied": applied,
    }


def _record(decision: Decision, current: CurrentConfig, budget_after: int, now: float,
            applied: bool) -> dict[str, Any]:
    return decision_record(
        time=format_time(now),
        before=(current.chunk_size, current.queue_policy, current.replicas),
        after=(budget_after, decision.queue_policy, decision.replicas),
        reason=decision.reason, policy=decision.policy_used, applied=applied,
    )


def _apply(result: TuneResult, tuned: Tuned, spec: AutotuneSpec, now: float) -> TuneResult:
    decision, current = tuned.decision, tuned.current
    if tuned.problem is not None:
        return replace(result, problem=tuned.problem)
    events = []
    if tuned.config is not None and decision.queue_policy != current.queue_policy:
        events.append(EventSpec(NORMAL, POLICY_SWITCHED, (
            f"queue policy {current.queue_policy} -> {decision.queue_policy}, prefill budget {current.chunk_size} -> "
            f"{prefill_budget(tuned.config.scheduler)}: {decision.reason}")))
    replicas = None
    if decision.replicas != current.replicas:
        replicas = max(spec.min_replicas, min(spec.max_replicas, decision.replicas))
        if replicas != current.replicas:
            events.append(EventSpec(NORMAL, SCALED, f"replicas {current.replicas} -> {replicas}: {decision.reason}"))
        else:
            replicas = None
    if tuned.config is None and replicas is None:
        return result
    budget = prefill_budget(tuned.config.scheduler) if tuned.config is not None else current.chunk_size
    return replace(result, config=tuned.config, replicas=replicas, events=tuple(events),
                   last_decision=_record(decision, current, budget, now, applied=True))


def _same_proposal(a: Mapping[str, Any] | None, b: Mapping[str, Any]) -> bool:
    if not isinstance(a, Mapping):
        return False
    return (a.get("applied"), a.get("from"), a.get("to")) == (b["applied"], b["from"], b["to"])


def _advise(result: TuneResult, decision: Decision, current: CurrentConfig, served: ServerConfigFile,
            status: Mapping[str, Any] | None, now: float) -> TuneResult:
    record = _record(decision, current, _proposed_budget(decision, current, served), now, applied=False)
    if _same_proposal((status or {}).get("lastDecision"), record):
        return result  # already recorded and announced
    event = EventSpec(NORMAL, ADVICE, f"would change {decision.describe_change(current)}: {decision.reason}")
    return replace(result, last_decision=record, events=(event,))


def _proposed_budget(decision: Decision, current: CurrentConfig, served: ServerConfigFile) -> int:
    """The budget the servers would enforce if the proposal were applied (its layout's)."""
    if (decision.chunk_size, decision.queue_policy) == (current.chunk_size, current.queue_policy):
        return current.chunk_size
    try:
        return prefill_budget(scheduler_for(decision, served.scheduler))
    except ConfigError:
        return decision.chunk_size


# --- per-object memory between readings ----------------------------------------------------------------------


@dataclass
class TunerMemory:
    """Kept in kopf's per-object memo: when to read next and what the last reading said (status is refreshed
    more often than Prometheus is read). Lost on restart, which only means an early first reading."""

    next_reading: float = 0.0
    spec_generation: int | None = None
    metrics: ServingMetrics | None = None
    pod_generations: Mapping[str, int] | None = None
    slo_override: tuple[str, str] | None = None
    last_change_time: float | None = None
    problem: str | None = None
    # The replica recommendations of the readings within the scale-down stabilization window (and the newest one
    # before it, which shows the window is covered); lost on restart, so a restarted operator waits a full window.
    recommendations: tuple[Recommendation, ...] = ()
    # The status timer and the change handlers of one object run in different threads: one reading at a time.
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def due(self, now: float, spec_generation: int) -> bool:
        """Read at the interval, and at once after a spec change (autotune switched on, new SLO, ...)."""
        return self.metrics is None or spec_generation != self.spec_generation or now >= self.next_reading

    def metrics_for(self, served_generation: int | None) -> ServingMetrics | None:
        """The last reading, with pods counted against the generation served now: right after a new config is
        written no pod is on it yet, whatever the reading before the write said."""
        if self.metrics is None:
            return None
        return replace(self.metrics, pods_on_generation=pods_on_generation(self.pod_generations, served_generation))

    def remember(self, result: TuneResult, now: float, spec_generation: int, interval_seconds: float,
                 stabilization_seconds: float = 0.0) -> str | None:
        """Store a reading; return the problem to announce if it is new (None when unchanged or gone)."""
        self.next_reading = now + interval_seconds
        self.spec_generation = spec_generation
        self.metrics = result.metrics
        self.pod_generations = result.pod_generations
        self.slo_override = result.slo_override
        if result.applied_change:
            self.last_change_time = now
        recommended = result.decision.recommended_replicas if result.decision is not None else None
        if recommended is not None:
            self.recommendations = prune((*self.recommendations, Recommendation(now, recommended)), now,
                                         stabilization_seconds)
        fresh = result.problem if result.problem != self.problem else None
        self.problem = result.problem
        return fresh
