"""Pure status: what the operator observed (Deployment, pods, served config, metrics) → the CR's `status`.

Conditions follow the Kubernetes API conventions: type/status/reason/message/lastTransitionTime/
observedGeneration, and lastTransitionTime only moves when status flips. `status_patch` keeps only what changed,
so a periodic refresh that observes nothing new writes nothing.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from metronome.contract.budget import prefill_budget, split_sizes
from metronome.contract.config import ServerConfigFile
from metronome.operator.builders import selector_string
from metronome.operator.external_scalers import ScalerView
from metronome.operator.model_fetch import FETCH_CONTAINER
from metronome.operator.refusals import Refusal
from metronome.operator.spec import InferenceService, SLOSpec
from metronome.operator.tuning.autotune import ServingMetrics
from metronome.operator.tuning.settings import AutotuneMode

READY = "Ready"
PROGRESSING = "Progressing"
METRICS_AVAILABLE = "MetricsAvailable"
SLO_MET = "SLOMet"
CONFIG_APPLIED = "ConfigApplied"
EXPERIMENT = "Experiment"  # only on services that have had an experiment (status.experiment)
REPLICAS_MANAGED_EXTERNALLY = "ReplicasManagedExternally"
CONDITION_TYPES = (READY, PROGRESSING, METRICS_AVAILABLE, SLO_MET, CONFIG_APPLIED, REPLICAS_MANAGED_EXTERNALLY,
                   EXPERIMENT)

TRUE, FALSE, UNKNOWN = "True", "False", "Unknown"
SLO_STATES = {TRUE: "Met", FALSE: "Violated", UNKNOWN: "Unknown"}


@dataclass(frozen=True)
class Observed:
    """Everything status is computed from; built by the handlers from API reads."""

    deployment: Mapping[str, Any] | None
    pods: tuple[Mapping[str, Any], ...] = ()
    served_config: ServerConfigFile | None = None
    config_error: str | None = None
    metrics: ServingMetrics | None = None
    # (reason, message) that replaces SLOMet's SLOViolated when the control loop cannot fix the violation
    # (chunk at its floor, no replicas to add): the condition then says why it stays violated.
    slo_override: tuple[str, str] | None = None
    scalers: ScalerView | None = None  # the HPAs and ScaledObjects that target the service (None: not looked)
    # The API server refused the children of this generation (refusals.Refusal): nothing of it was written, the
    # pods run the generation last applied.
    refusal: Refusal | None = None
    experiment: Mapping[str, Any] | None = None  # status.experiment as this reconcile leaves it


def condition(
    type_: str,
    status: str,
    reason: str,
    message: str,
    *,
    generation: int,
    now: str,
    previous: Iterable[Mapping[str, Any]] = (),
) -> dict[str, Any]:
    before = next((c for c in previous if c.get("type") == type_), None)
    unchanged = before is not None and before.get("status") == status and before.get("lastTransitionTime")
    return {
        "type": type_,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": before["lastTransitionTime"] if unchanged else now,
        "observedGeneration": generation,
    }


# --- the Deployment ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rollout:
    desired: int
    replicas: int
    ready: int
    updated: int
    available: int
    current: bool  # the Deployment controller has seen the latest Deployment spec
    deadline_exceeded: bool
    # The Deployment's ReplicaFailure condition ("FailedCreate: pods ... forbidden: exceeded quota"): pods that
    # could not even be created (quota, admission webhooks, pod security), so there are none to explain it.
    replica_failure: str | None = None
    # The Deployment controller's own verdict (its Progressing condition, reason NewReplicaSetAvailable): the
    # latest rollout finished. Pods that become unavailable afterwards (a node lost, the API server away and
    # the node controller marking pods not ready) start no rollout: that is Ready's business, not Progressing's.
    complete: bool = False

    @property
    def on_current_template(self) -> bool:
        """Every pod the Deployment runs is of its latest template, and there are as many as desired."""
        return self.current and self.updated >= self.desired and self.replicas == self.desired

    @property
    def settled(self) -> bool:
        return self.current and self.updated >= self.desired and self.replicas == self.desired and (
            self.available >= self.desired
        )


def rollout_of(deployment: Mapping[str, Any], desired: int) -> Rollout:
    status = deployment.get("status") or {}
    metadata = deployment.get("metadata") or {}
    conditions = status.get("conditions") or []
    return Rollout(
        desired=desired,
        replicas=int(status.get("replicas") or 0),
        ready=int(status.get("readyReplicas") or 0),
        updated=int(status.get("updatedReplicas") or 0),
        available=int(status.get("availableReplicas") or 0),
        current=int(status.get("observedGeneration") or 0) >= int(metadata.get("generation") or 0),
        deadline_exceeded=any(
            c.get("type") == "Progressing" and c.get("reason") == "ProgressDeadlineExceeded" for c in conditions
        ),
        replica_failure=next(
            (f"{c.get('reason') or 'ReplicaFailure'}: {c.get('message') or ''}".rstrip(": ")
             for c in conditions if c.get("type") == "ReplicaFailure" and c.get("status") == "True"),
            None,
        ),
        complete=any(
            c.get("type") == "Progressing" and c.get("status") == "True" and c.get("reason") == "NewReplicaSetAvailable"
            for c in conditions
        ),
    )


# Why a container is not running, by the kubelet's waiting reasons, and the condition reason each becomes.
IMAGE_PULL_REASONS = frozenset({"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull",
                                "RegistryUnavailable", "SignatureValidationFailed"})
CONTAINER_CONFIG_REASONS = frozenset({"CreateContainerConfigError", "CreateContainerError"})
STARTING_REASONS = frozenset({None, "", "ContainerCreating", "PodInitializing"})
# Which problem Ready names when pods have several (the first of these that occurs).
PROBLEM_ORDER = ("ModelDownloadFailed", "ImagePullFailed", "ContainerConfigError", "Unschedulable", "PodsFailing")
TERMINATION_MESSAGE_CHARS = 400  # the end of a container's log is where its error is


@dataclass(frozen=True)
class PodProblem:
    reason: str  # one of PROBLEM_ORDER
    text: str


def _squeeze(text: str | None, limit: int = TERMINATION_MESSAGE_CHARS) -> str:
    words = " ".join(str(text or "").split())
    return words if len(words) <= limit else "…" + words[-limit:]


def _exit_text(terminated: Mapping[str, Any] | None) -> str:
    if not terminated or not terminated.get("exitCode"):
        return ""
    text = f"exit code {terminated['exitCode']}"
    if terminated.get("reason"):
        text += f" ({terminated['reason']})"
    message = _squeeze(terminated.get("message"))
    return f"{text}: {message}" if message else text


def container_problem(pod: str, status: Mapping[str, Any], init: bool) -> PodProblem | None:
    """Why one container of a pod does not run, in the kubelet's words (None: it runs, or is still starting)."""
    name = status.get("name", "?")
    state = status.get("state") or {}
    waiting, terminated = state.get("waiting"), state.get("terminated")
    last = (status.get("lastState") or {}).get("terminated")
    fetch = init and name == FETCH_CONTAINER
    label = f"{pod}: {'init container' if init else 'container'} {name}" + (" (the model download)" if fetch else "")
    if waiting and waiting.get("reason") not in STARTING_REASONS:
        why = waiting["reason"]
        if why in IMAGE_PULL_REASONS:
            reason = "ImagePullFailed"
            label += f" image {status.get('image')}" if status.get("image") else ""
        elif why in CONTAINER_CONFIG_REASONS:
            reason = "ContainerConfigError"
        else:
            reason = "ModelDownloadFailed" if fetch else "PodsFailing"
        detail = _squeeze(waiting.get("message"))
        text = f"{label}: {why}" + (f": {detail}" if detail else "")
        exited = _exit_text(last)
        return PodProblem(reason, f"{text}; last {exited}" if exited else text)
    if terminated and terminated.get("exitCode") and (init or not status.get("ready")):
        return PodProblem("ModelDownloadFailed" if fetch else "PodsFailing", f"{label}: {_exit_text(terminated)}")
    return None


def pod_problems(pods: Iterable[Mapping[str, Any]], limit: int = 2) -> list[PodProblem]:
    """Why pods are not ready, in the words the scheduler and kubelet used: the first few distinct ones, the most
    specific first (PROBLEM_ORDER). Pods being deleted are not counted."""
    problems: list[PodProblem] = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        if meta.get("deletionTimestamp"):
            continue
        name = meta.get("name", "?")
        status = pod.get("status") or {}
        for cond in status.get("conditions") or []:
            if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
                why = f"{cond.get('reason') or 'Unschedulable'}: {cond.get('message', '')}".rstrip(": ")
                problems.append(PodProblem("Unschedulable", f"{name}: {why}"))
        if status.get("phase") == "Failed":
            why = f"{status.get('reason') or 'Failed'}: {status.get('message') or ''}".rstrip(": ")
            problems.append(PodProblem("PodsFailing", f"{name}: {why}"))
        for init, key in ((True, "initContainerStatuses"), (False, "containerStatuses")):
            for container in status.get(key) or []:
                problem = container_problem(name, container, init)
                if problem is not None:
                    problems.append(problem)
    unique = list(dict.fromkeys(problems))
    unique.sort(key=lambda p: PROBLEM_ORDER.index(p.reason))
    return unique[:limit]


def _ready(pod: Mapping[str, Any]) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


def _starting(pod: Mapping[str, Any]) -> bool:
    """A pod on its way up: not scheduled or initialised yet, or its containers not started yet, never restarted."""
    status = pod.get("status") or {}
    if status.get("phase") in (None, "Pending"):
        return True
    unready = [c for c in status.get("containerStatuses") or [] if not c.get("ready")]
    return bool(unready) and all(
        not c.get("restartCount") and (not c.get("started") or (c.get("state") or {}).get("waiting"))
        for c in unready)


def pods_starting(rollout: Rollout, pods: Iterable[Mapping[str, Any]]) -> bool:
    """The missing ready pods are on their way: not created yet (a scale-up), or every unready pod is starting."""
    live = [p for p in pods if not (p.get("metadata") or {}).get("deletionTimestamp")]
    unready = [p for p in live if not _ready(p)]
    if rollout.replicas < rollout.desired and not unready:
        return True
    return bool(unready) and all(_starting(p) for p in unready)


def ready_condition(rollout: Rollout | None, pods: Iterable[Mapping[str, Any]],
                    refusal: Refusal | None = None, generation: int = 0) -> tuple[str, str, str]:
    pods = list(pods)
    if refusal is not None:
        running = f"{rollout.ready}/{rollout.desired} pods ready" if rollout is not None else "no pods"
        return FALSE, refusal.reason, f"generation {generation} was not applied ({running} of the last one " \
                                      f"applied): {refusal.message}"
    if rollout is None:
        return FALSE, "DeploymentMissing", "the server Deployment does not exist yet"
    if rollout.desired == 0:
        return TRUE, "ScaledToZero", "replicas is 0"
    summary = f"{rollout.ready}/{rollout.desired} server pods ready"
    if rollout.ready >= rollout.desired and rollout.settled:
        return TRUE, "AllReplicasReady", summary
    if rollout.replica_failure:
        return FALSE, "ReplicaFailure", f"{summary}; {rollout.replica_failure}"
    problems = pod_problems(pods)
    if problems:
        return FALSE, problems[0].reason, "; ".join([summary, *(p.text for p in problems)])
    if rollout.ready >= rollout.desired:
        return FALSE, "RollingOut", f"{summary}; rolling out: {rollout.updated}/{rollout.desired} on the " \
                                    "current template"
    if pods_starting(rollout, pods):
        return FALSE, "PodsStarting", f"{summary}; the others are starting"
    return FALSE, "ReplicasNotReady", summary


def progressing_condition(rollout: Rollout | None, refusal: Refusal | None = None) -> tuple[str, str, str]:
    if refusal is not None:
        return FALSE, refusal.reason, "the latest generation was not applied: Ready says why"
    if rollout is None:
        return TRUE, "Creating", "creating the server Deployment"
    if rollout.deadline_exceeded:
        return FALSE, "ProgressDeadlineExceeded", "the rollout made no progress within its deadline"
    if rollout.settled:
        return FALSE, "Stable", f"{rollout.updated} pods on the current template"
    if rollout.on_current_template and rollout.complete:
        return FALSE, "RolloutComplete", (
            f"the rollout is complete: {rollout.updated} pods on the current template, {rollout.available} "
            f"available"
        )
    return TRUE, "RollingOut", (
        f"{rollout.updated}/{rollout.desired} pods on the current template, {rollout.available} available"
    )


# --- config and metrics --------------------------------------------------------------------------------------


def config_condition(observed: Observed, rollout: Rollout | None) -> tuple[str, str, str]:
    if observed.config_error:
        return FALSE, "InvalidConfig", observed.config_error
    config = observed.served_config
    if config is None:
        return FALSE, "ConfigMapMissing", "server.yaml has not been written yet"
    metrics = observed.metrics
    # Generations are read even when there is no traffic (no TBT samples): only their absence is unknown.
    if metrics is None or metrics.pods_on_generation is None:
        return UNKNOWN, "GenerationNotObserved", (
            f"generation {config.generation} written; waiting for the pods to report metronome_config_generation"
        )
    ready = rollout.ready if rollout is not None else 0
    if ready == 0:
        return UNKNOWN, "NoReadyPods", f"generation {config.generation} written; no ready pod to serve it yet"
    # Prometheus may still count pods that are gone or not ready: only ready pods are counted against.
    serving = min(metrics.pods_on_generation, ready)
    message = f"{serving}/{ready} ready pods serve generation {config.generation}"
    if serving >= ready:
        return TRUE, "AllPodsOnGeneration", message
    return FALSE, "PodsOnOlderGeneration", message


def metrics_condition(metrics: ServingMetrics | None) -> tuple[str, str, str]:
    if metrics is None:
        return UNKNOWN, "NotObserved", "metrics have not been read yet"
    if not metrics.available:
        return FALSE, metrics.reason or "NoData", metrics.message or "no samples in the metrics window"
    return TRUE, metrics.reason or "MetricsRead", metrics.message or "metrics read from Prometheus"


def slo_violations(slo: SLOSpec, metrics: ServingMetrics) -> list[str]:
    violations = []
    if metrics.tbt_p99_ms is not None and metrics.tbt_p99_ms > slo.tbt_p99_ms:
        violations.append(f"TBT p99 {metrics.tbt_p99_ms:.1f} ms > {slo.tbt_p99_ms:g} ms")
    if slo.ttft_p99_ms is not None and metrics.ttft_p99_ms is not None and metrics.ttft_p99_ms > slo.ttft_p99_ms:
        violations.append(f"TTFT p99 {metrics.ttft_p99_ms:.1f} ms > {slo.ttft_p99_ms:g} ms")
    floor = slo.min_throughput_tokens_per_second
    tput = metrics.throughput_tokens_per_second
    if floor is not None and tput is not None and tput < floor:
        violations.append(f"throughput {tput:.1f} tok/s < {floor:g} tok/s")
    return violations


def slo_condition(
    slo: SLOSpec | None, metrics: ServingMetrics | None, override: tuple[str, str] | None = None
) -> tuple[str, str, str]:
    if slo is None:
        return UNKNOWN, "NoSLO", "spec.slo is not set"
    if metrics is None or not metrics.available or metrics.tbt_p99_ms is None:
        return UNKNOWN, "NoData", "no TBT samples to judge the SLO by"
    violations = slo_violations(slo, metrics)
    if violations and override is not None:
        reason, why = override
        return FALSE, reason, "; ".join([*violations, why])
    if violations:
        return FALSE, "SLOViolated", "; ".join(violations)
    return TRUE, "SLOMet", f"TBT p99 {metrics.tbt_p99_ms:.1f} ms <= {slo.tbt_p99_ms:g} ms"


def experiment_condition(experiment: Mapping[str, Any]) -> tuple[str, str, str]:
    """True while an experiment has a candidate slice (starting or measuring); False while it waits (e.g.
    NotEnoughReplicas: fewer than 2 replicas leave no slice) or once it has ended (the outcome as reason)."""
    phase = experiment.get("phase") or ""
    message = experiment.get("message") or ""
    if phase in ("Starting", "Running"):
        return TRUE, experiment.get("reason") or phase, message
    if phase == "Pending":
        return FALSE, experiment.get("reason") or phase, message
    return FALSE, phase or "Unknown", message


def replicas_condition(service: InferenceService, scalers: ScalerView | None) -> tuple[str, str, str]:
    """Whether an HPA or a KEDA ScaledObject sets the replicas (then the control loop leaves them alone), and if
    not, who does."""
    if scalers is None:
        return UNKNOWN, "NotObserved", "HorizontalPodAutoscalers and ScaledObjects have not been looked at yet"
    if scalers.scalers:
        first = scalers.scalers[0]
        targets = " and ".join(sorted({s.target_kind for s in scalers.scalers}))
        return TRUE, first.kind, (f"{scalers.owner} sets the replicas of the {targets}: the control loop leaves "
                                  "them alone and still tunes the chunk size and queue policy")
    autotune = service.spec.autotune
    if autotune.scale_replicas and autotune.mode is AutotuneMode.APPLY:
        return FALSE, "AutotuneScales", (f"the control loop sets spec.replicas within [{autotune.min_replicas}, "
                                         f"{autotune.max_replicas}]")
    return FALSE, "SpecReplicas", "spec.replicas as set (by hand, kubectl scale or the scale subresource)"


def desired_replicas(service: InferenceService, observed: Observed) -> int:
    """The pods there should be: spec.replicas, or the Deployment's own count while a scaler drives it directly or
    while the children of this generation are refused (the pods run the generation last applied)."""
    on_deployment = observed.scalers is not None and observed.scalers.on_deployment
    if (on_deployment or observed.refusal is not None) and observed.deployment is not None:
        return int((observed.deployment.get("spec") or {}).get("replicas", service.spec.replicas))
    return service.spec.replicas


# --- the whole status ----------------------------------------------------------------------------------------


def served_config_fields(config: ServerConfigFile | None) -> dict[str, Any]:
    """The status fields that show what server.yaml serves (None clears them): chunkSize is the prefill budget the
    servers enforce (metronome.contract.budget), splitChunkSizes split's short/long sizes where they differ."""
    return {
        "chunkSize": prefill_budget(config.scheduler) if config else None,
        "splitChunkSizes": split_sizes(config.scheduler) if config else None,
        "queuePolicy": config.scheduler.queue_policy.value if config else None,
        "configGeneration": config.generation if config else None,
    }


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(float(value), 1)


def compute_status(
    service: InferenceService,
    observed: Observed,
    *,
    now: str,
    previous_conditions: Iterable[Mapping[str, Any]] = (),
    applied_generation: int | None = None,
) -> dict[str, Any]:
    """The full desired status (lastDecision excepted: the control loop owns it). None = clear the field.
    `applied_generation`: the generation last applied, reported as observedGeneration while the children of this
    one are refused (observed.refusal); otherwise this generation is the applied one."""
    previous = list(previous_conditions)
    refusal = observed.refusal
    desired = desired_replicas(service, observed)
    rollout = rollout_of(observed.deployment, desired) if observed.deployment is not None else None
    metrics = observed.metrics

    def make(type_: str, verdict: tuple[str, str, str]) -> dict[str, Any]:
        status, reason, message = verdict
        return condition(type_, status, reason, message, generation=service.generation, now=now, previous=previous)

    slo_verdict = slo_condition(service.spec.slo, metrics, observed.slo_override)
    conditions = [
        make(READY, ready_condition(rollout, observed.pods, refusal, service.generation)),
        make(PROGRESSING, progressing_condition(rollout, refusal)),
        make(METRICS_AVAILABLE, metrics_condition(metrics)),
        make(SLO_MET, slo_verdict),
        make(CONFIG_APPLIED, config_condition(observed, rollout)),
        make(REPLICAS_MANAGED_EXTERNALLY, replicas_condition(service, observed.scalers)),
    ]
    if observed.experiment:
        conditions.append(make(EXPERIMENT, experiment_condition(observed.experiment)))
    ready = rollout.ready if rollout else 0
    have_metrics = metrics is not None and metrics.available
    return {
        "observedGeneration": service.generation if refusal is None else applied_generation,
        "conditions": conditions,
        "replicas": rollout.replicas if rollout else 0,
        "readyReplicas": ready,
        "ready": f"{ready}/{desired}",
        "selector": selector_string(service.name),
        **served_config_fields(observed.served_config),
        "podsOnGeneration": metrics.pods_on_generation if metrics is not None else None,
        "tbtP99Ms": _rounded(metrics.tbt_p99_ms) if have_metrics else None,
        "ttftP99Ms": _rounded(metrics.ttft_p99_ms) if have_metrics else None,
        "throughputTokensPerSecond": _rounded(metrics.throughput_tokens_per_second) if have_metrics else None,
        "slo": SLO_STATES[slo_verdict[0]],
    }


def status_patch(current: Mapping[str, Any] | None, desired: Mapping[str, Any]) -> dict[str, Any]:
    """The merge patch that turns `current` into `desired` for the keys `desired` names (None deletes)."""
    current = current or {}
    return {key: value for key, value in desired.items() if current.get(key) != value}


def invalid_spec_conditions(message: str, *, generation: int, now: str,
                            previous: Iterable[Mapping[str, Any]] = ()) -> list[dict[str, Any]]:
    """A spec the operator cannot use (SpecError): Ready and Progressing say so; what the other conditions say of
    the pods that still run stays as it was."""
    previous = list(previous)
    refused = {
        READY: (FALSE, "InvalidSpec", f"generation {generation} was not applied: {message}"),
        PROGRESSING: (FALSE, "InvalidSpec", "the latest generation was not applied: Ready says why"),
    }
    out = []
    for type_ in CONDITION_TYPES:
        if type_ in refused:
            status, reason, text = refused[type_]
            out.append(condition(type_, status, reason, text, generation=generation, now=now, previous=previous))
        else:
            out.extend(c for c in previous if c.get("type") == type_)
    return out
