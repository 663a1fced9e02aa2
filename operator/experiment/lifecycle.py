"""One step of an experiment's life: the wanted experiment, its status record and what was observed → the next
record and what to carry out. Pure; the glue reads the pods, the served config and Prometheus, calls `step`, and
writes what the Step says (labels, the candidate ConfigMap, the promoted config, Events, status.experiment).

    (no record) ──► Pending ──► Starting ──► Running ──► Promoted | Reverted | NoDifference
                      │            │            │
                      └────────────┴────────────┴──► Aborted (cancelled, a candidate pod lost, no data, ...)

- Pending waits for at least 2 replicas (a slice that leaves a control), every pod ready, and every pod on the
  served config's generation: an experiment created while the autotuner is mid-change starts once that change
  has reached every pod, and the autotuner makes no change meanwhile (`pause_tuner`), so it cannot move the
  control under the comparison.
- Starting writes the candidate ConfigMap (generation: one past every generation served so far, so a pod's
  metronome_config_generation tells which config it runs) and labels the chosen pods; it waits until each
  candidate pod reports the candidate's generation and each control pod the control's.
- Running measures windows from the moment the last candidate pod applied the candidate (its
  metronome_config_applied_timestamp_seconds) and asks verdict.judge after each. A candidate pod that is gone
  aborts (no data can replace its own); one that is not ready leaves the windows meanwhile uncounted (it gets no
  traffic), and more skipped windows than planned ones aborts; the control's config changing (spec.server
  edited) aborts, since the comparison no longer holds. Nothing is ever promoted on windows that did not count.
- The end relabels every pod control and deletes the candidate ConfigMap; promotion first writes the candidate
  as the service's served config (server.yaml, a new generation: spec.server keeps the initial values, as after
  an autotune change, and the autotuner goes on from the promoted config). The autotuner stays paused until
  every former candidate pod serves the service's config again.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pydantic.alias_generators import to_camel

from metronome.contract import variant
from metronome.contract.budget import prefill_budget
from metronome.contract.config import SchedulerConfig, ServerConfigFile, validate_scheduler
from metronome.operator.changes import NORMAL, WARNING, EventSpec
from metronome.operator.experiment.children import PodView, choose_candidates, label_changes
from metronome.operator.experiment.record import AUTOTUNE, Phase, Record
from metronome.operator.experiment.settings import ExperimentSpec, candidate_count, validate_candidate
from metronome.operator.experiment.verdict import Outcome, WindowReading, judge

START_TIMEOUT_S = 600.0  # a real kubelet projects a change within ~2 min; 10 min without it is a broken pod
OUTCOME_PHASES = {Outcome.PROMOTED: Phase.PROMOTED, Outcome.REVERTED: Phase.REVERTED,
                  Outcome.NO_DIFFERENCE: Phase.NO_DIFFERENCE}


@dataclass(frozen=True)
class Wanted:
    """The experiment the service asks for now: spec.experiment, or an autotune canary."""

    spec: ExperimentSpec
    source: str

    @property
    def id(self) -> str:
        return self.spec.identity


@dataclass(frozen=True)
class Observed:
    replicas: int  # spec.replicas
    pods: tuple[PodView, ...]  # the service's pods that are not being deleted
    served: ServerConfigFile | None  # the control: what server.yaml serves
    pod_generations: Mapping[str, int] | None  # metronome_config_generation by pod; None = Prometheus not read
    applied_at: Mapping[str, float] = field(default_factory=dict)  # when each pod applied its config
    readings: Sequence[WindowReading] | None = None  # the complete windows, while running; None = not read
    readings_problem: str | None = None  # why there are none (Prometheus unavailable)


@dataclass(frozen=True)
class Step:
    record: Record | None
    labels: Mapping[str, str] = field(default_factory=dict)  # pod → variant to set
    candidate_config: ServerConfigFile | None = None  # write the candidate ConfigMap
    delete_candidate_config: bool = False
    control_config: ServerConfigFile | None = None  # serve this as the service's config (promotion)
    events: tuple[EventSpec, ...] = ()
    pause_tuner: bool = False


def describe_scheduler(scheduler: SchedulerConfig) -> str:
    return f"prefill budget {prefill_budget(scheduler)} under {scheduler.queue_policy.value}"


def scheduler_record(scheduler: SchedulerConfig) -> dict:
    """A scheduler config as status.experiment.candidate shows it (camelCase, unset fields left out)."""
    return {to_camel(key): value for key, value in scheduler.snake_dict().items() if value is not None}


def _event(record: Record, kind: str = NORMAL) -> EventSpec:
    return EventSpec(kind, f"Experiment{record.phase.value}" if record.phase is not Phase.RUNNING else
                     "ExperimentMeasuring", record.message)


def step(wanted: Wanted | None, record: Record | None, observed: Observed, now: float) -> Step:
    if record is not None and record.active:
        if wanted is None:
            return _finish(record, Phase.ABORTED, "Cancelled", "the experiment was removed from the spec", observed,
                           now)
        if wanted.id != record.id:
            return _finish(record, Phase.ABORTED, "Superseded", "the experiment's spec changed; the new one starts "
                           "next", observed, now)
        if record.phase is Phase.PENDING:
            return _pending(wanted, record, observed, now)
        if record.phase is Phase.STARTING:
            return _starting(wanted, record, observed, now)
        return _running(wanted, record, observed, now)
    if wanted is None or (record is not None and record.id == wanted.id):
        return _after(record, observed, now)
    fresh = Record(id=wanted.id, source=wanted.source, phase=Phase.PENDING, reason="Created", message="created",
                   name=wanted.spec.name, windows_planned=wanted.spec.windows, candidate=_proposal(wanted),
                   candidate_generation=record.candidate_generation if record is not None else None)
    return _pending(wanted, fresh, observed, now, created=True)


def _proposal(wanted: Wanted) -> dict | None:
    """An autotune canary's candidate is a whole config, known before the start: the record keeps it from the
    first step, so that the canary can be rebuilt from the record while it waits (canary.running_canary)."""
    if wanted.source != AUTOTUNE:
        return None
    return scheduler_record(validate_scheduler(dict(wanted.spec.candidate.fields), source="the autotune proposal"))


# --- the phases ----------------------------------------------------------------------------------------------


def _pending(wanted: Wanted, record: Record, observed: Observed, now: float, created: bool = False) -> Step:
    spec = wanted.spec
    count = candidate_count(spec.share, observed.replicas)
    served = observed.served
    ready = [p for p in observed.pods if p.ready]
    wait = None
    if count is None:
        wait = ("NotEnoughReplicas", f"spec.replicas is {observed.replicas}: an experiment needs at least 2 (one "
                "candidate, one control); it starts when the service has them")
    elif served is None:
        wait = ("ConfigMissing", "the service serves no config yet")
    elif len(ready) < observed.replicas or len(observed.pods) != observed.replicas:
        wait = ("PodsNotReady", f"{len(ready)}/{observed.replicas} pods ready; waiting for all of them")
    elif observed.pod_generations is None:
        wait = ("GenerationsUnknown", "waiting for Prometheus to show each pod's config generation")
    else:
        lagging = sorted(p.name for p in ready if observed.pod_generations.get(p.name) != served.generation)
        leftover = sorted(p.name for p in observed.pods if p.variant == variant.CANDIDATE)
        if lagging:
            wait = ("ConfigSettling", f"{len(lagging)}/{len(ready)} pods not yet on generation "
                    f"{served.generation} (e.g. {lagging[0]}); starting once the config has settled")
        elif leftover:
            wait = ("PreviousCandidates", f"pods still labelled candidate: {', '.join(leftover)}")
    if wait is not None:
        reason, message = wait
        waiting = record.but(reason=reason, message=message)
        changed = created or reason != record.reason
        events = (_event(waiting, WARNING if reason == "NotEnoughReplicas" else NORMAL),) if changed else ()
        return Step(waiting, events=events, pause_tuner=reason != "NotEnoughReplicas")
    candidate, problem = validate_candidate(spec.candidate, served.scheduler)
    if candidate is None:
        aborted = record.but(phase=Phase.ABORTED, reason="InvalidCandidate", message=problem, decided_at=now)
        return Step(aborted, events=(_event(aborted, WARNING),))
    pods = choose_candidates(observed.pods, count)
    generation = max(served.generation, record.candidate_generation or 0) + 1
    config = ServerConfigFile(generation=generation, scheduler=candidate)
    starting = record.but(
        phase=Phase.STARTING, reason="CandidateLabelled", candidate=scheduler_record(candidate), candidate_pods=pods,
        candidate_generation=generation, control_generation=served.generation, started_at=now,
        message=(f"candidate ({describe_scheduler(candidate)}, generation {generation}) on {', '.join(pods)} "
                 f"({len(pods)} of {observed.replicas} pods) against the control "
                 f"({describe_scheduler(served.scheduler)}, generation {served.generation}); {spec.windows} windows "
                 f"of {spec.window_seconds} s; autotune pauses until it ends"))
    return Step(starting, labels=label_changes(observed.pods, pods, everyone=True), candidate_config=config,
                events=(EventSpec(NORMAL, "ExperimentStarted", starting.message),), pause_tuner=True)


def _lost(record: Record, observed: Observed) -> str | None:
    names = {p.name for p in observed.pods}
    gone = [pod for pod in record.candidate_pods if pod not in names]
    return f"candidate pod {gone[0]} is gone; no other pod's data can stand in for it" if gone else None


def _control_changed(record: Record, observed: Observed) -> str | None:
    if observed.served is None or observed.served.generation == record.control_generation:
        return None
    return (f"the control's config moved from generation {record.control_generation} to "
            f"{observed.served.generation} (spec.server edited?): the comparison no longer holds")


def _guards(record: Record, observed: Observed) -> tuple[str, str] | None:
    """Why a started experiment cannot go on (reason, message), or None."""
    lost = _lost(record, observed)
    if lost:
        return "CandidatePodLost", lost
    changed = _control_changed(record, observed)
    if changed:
        return "ControlChanged", changed
    if observed.replicas < 2:
        return "NotEnoughReplicas", f"spec.replicas dropped to {observed.replicas}: no control left to compare with"
    return None


def _starting(wanted: Wanted, record: Record, observed: Observed, now: float) -> Step:
    guard = _guards(record, observed)
    if guard:
        return _finish(record, Phase.ABORTED, *guard, observed, now)
    labels = label_changes(observed.pods, record.candidate_pods, everyone=True)
    generations = observed.pod_generations or {}
    on_candidate = [p for p in record.candidate_pods if generations.get(p) == record.candidate_generation]
    controls = [p.name for p in observed.pods if p.name not in record.candidate_pods and p.ready]
    controls_ok = all(generations.get(p) == record.control_generation for p in controls)
    if len(on_candidate) == len(record.candidate_pods) and controls_ok and observed.pod_generations is not None:
        applied = [observed.applied_at[p] for p in record.candidate_pods if p in observed.applied_at]
        since = float(math.ceil(max(applied))) if len(applied) == len(record.candidate_pods) else float(math.ceil(now))
        running = record.but(phase=Phase.RUNNING, reason="Measuring", measuring_since=since, message=(
            f"every candidate pod serves generation {record.candidate_generation}; measuring "
            f"{wanted.spec.windows} windows of {wanted.spec.window_seconds} s"))
        return Step(running, labels=labels, events=(_event(running),), pause_tuner=True)
    if record.started_at is not None and now - record.started_at > START_TIMEOUT_S:
        lagging = [p for p in record.candidate_pods if p not in on_candidate]
        return _finish(record, Phase.ABORTED, "CandidateNotApplied", (
            f"after {START_TIMEOUT_S:.0f} s {', '.join(lagging) or 'a control pod'} still did not report its "
            "generation"), observed, now)
    waiting = record.but(message=f"{len(on_candidate)}/{len(record.candidate_pods)} candidate pods serve "
                                 f"generation {record.candidate_generation}")
    return Step(waiting, labels=labels, pause_tuner=True)


def _running(wanted: Wanted, record: Record, observed: Observed, now: float) -> Step:
    guard = _guards(record, observed)
    if guard:
        return _finish(record, Phase.ABORTED, *guard, observed, now)
    labels = label_changes(observed.pods, record.candidate_pods, everyone=True)
    if observed.readings is None:
        waiting = record.but(reason="MetricsUnavailable",
                             message=f"no windows read: {observed.readings_problem or 'Prometheus not read'}")
        return Step(waiting, labels=labels, pause_tuner=True)
    spec = wanted.spec
    verdict = judge(observed.readings, spec, len(record.candidate_pods))
    measured = record.but(windows=verdict.counted, windows_skipped=verdict.skipped, ratios=verdict.ratios())
    if verdict.decided:
        return _finish(measured, OUTCOME_PHASES[verdict.outcome], verdict.reason, verdict.message, observed, now)
    if verdict.skipped > spec.windows:
        return _finish(measured, Phase.ABORTED, "NotEnoughData", (
            f"{verdict.skipped} windows did not count (last: {verdict.last_problem}), more than the "
            f"{spec.windows} planned"), observed, now)
    unready = [p.name for p in observed.pods if p.name in record.candidate_pods and not p.ready]
    if unready:
        reason, message = "CandidatePodNotReady", (f"paused: candidate pod {unready[0]} is not ready; windows "
                                                    f"without its traffic do not count ({verdict.message})")
    else:
        reason, message = "Measuring", verdict.message + (f"; {verdict.skipped} skipped ({verdict.last_problem})"
                                                          if verdict.skipped else "")
    events = (EventSpec(WARNING, "ExperimentPaused", message),) if reason != record.reason and unready else ()
    return Step(measured.but(reason=reason, message=message), labels=labels, events=events, pause_tuner=True)


def _finish(record: Record, phase: Phase, reason: str, message: str, observed: Observed, now: float) -> Step:
    """End the experiment: every pod back to control, the candidate ConfigMap gone and, on promotion, the
    candidate served as the service's config."""
    control = None
    served = observed.served
    if phase is Phase.PROMOTED and record.candidate is not None and served is not None:
        scheduler = validate_scheduler(dict(record.candidate), source="status.experiment.candidate")
        generation = max(served.generation, record.candidate_generation or 0) + 1
        control = ServerConfigFile(generation=generation, scheduler=scheduler)
        message += f"; now served as generation {generation} to every pod"
    done = record.but(phase=phase, reason=reason, message=message, decided_at=now)
    kind = WARNING if phase is Phase.ABORTED else NORMAL
    return Step(done, labels=label_changes(observed.pods, (), everyone=False), control_config=control,
                delete_candidate_config=True, events=(_event(done, kind),), pause_tuner=True)


def _after(record: Record | None, observed: Observed, now: float) -> Step:
    """No experiment on: keep the cluster clean of the last one, and keep the autotuner paused until its former
    candidate pods serve the service's config again (bounded, so that a pod that never reports cannot hold the
    autotuner for ever)."""
    if record is None:
        return Step(None)
    labels = label_changes(observed.pods, (), everyone=False)
    generations = observed.pod_generations or {}
    served = observed.served
    returning = served is not None and any(generations.get(p, served.generation) != served.generation
                                           for p in record.candidate_pods)
    recent = record.decided_at is not None and now - record.decided_at < START_TIMEOUT_S
    return Step(record, labels=labels, delete_candidate_config=recent or bool(labels),
                pause_tuner=bool(labels) or (returning and recent))

