"""Pure: turn what the operator changed into Event (type, reason, message) triples that people can read."""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from metronome.contract.config import ServerConfigFile

NORMAL, WARNING = "Normal", "Warning"


@dataclass(frozen=True)
class EventSpec:
    type: str
    reason: str
    message: str


def _camel(snake: str) -> str:
    head, *rest = snake.split("_")
    return head + "".join(part.title() for part in rest)


def describe_child(created: bool, before: Mapping[str, Any] | None, after: Mapping[str, Any]) -> EventSpec | None:
    """An Event for a child the operator just wrote: created, or its spec changed (a concurrent status update, a
    label or the operator's fingerprint are not news). None when the write changed nothing, or when what was there
    before is not known."""
    kind, name = after.get("kind", "Object"), (after.get("metadata") or {}).get("name", "?")
    if created:
        return EventSpec(NORMAL, "Created", f"created {kind} {name}")
    if before is None:
        return None
    old_spec, new_spec = before.get("spec") or {}, after.get("spec") or {}
    if old_spec == new_spec:
        return None
    if kind == "Deployment":
        if old_spec.get("template") != new_spec.get("template"):
            return EventSpec(NORMAL, "RollingUpdate", f"pod template of Deployment {name} changed: pods roll")
        if old_spec.get("replicas") != new_spec.get("replicas"):
            return EventSpec(
                NORMAL, "Scaled", f"Deployment {name} replicas {old_spec.get('replicas')} -> {new_spec.get('replicas')}"
            )
    return EventSpec(NORMAL, "Updated", f"updated {kind} {name}")


def describe_config(before: ServerConfigFile | None, after: ServerConfigFile, why: str) -> EventSpec | None:
    """An Event for a new server.yaml generation; None when the generation did not move."""
    if before is None:
        fields = ", ".join(f"{_camel(k)} {v}" for k, v in after.scheduler.snake_dict().items() if v is not None)
        return EventSpec(NORMAL, "ConfigCreated", f"server.yaml generation {after.generation} ({why}): {fields}")
    if before.generation == after.generation:
        return None
    old, new = before.scheduler.snake_dict(), after.scheduler.snake_dict()
    diffs = [f"{_camel(k)} {old.get(k)} -> {new[k]}" for k in new if old.get(k) != new[k]]
    changed = ", ".join(diffs) or "no scheduler change"
    return EventSpec(
        NORMAL,
        "ConfigUpdated",
        f"server.yaml generation {before.generation} -> {after.generation} ({why}): {changed}",
    )


# Reasons that mean something is wrong (not merely on its way), whatever came before.
PROBLEM_REASONS = frozenset({"PodsFailing", "ProgressDeadlineExceeded", "InvalidConfig", "SLOViolated",
                             "ReplicaFailure", "ModelDownloadFailed", "ImagePullFailed", "ContainerConfigError",
                             "Unschedulable"})
# MetricsAvailable=False because Prometheus failed (not merely idle), and an SLO the autotuner cannot restore.
PROBLEM_REASONS |= {"PrometheusUnreachable", "PrometheusTimeout", "QueryFailed", "BadResponse", "NoSeries",
                    "InvalidMetricsSettings", "ChunkAtFloor"}
# Transitions the operator or the user started (a scale-up, a rollout, a new config generation): never a Warning,
# though a condition falls from True to False.
PLANNED_REASONS = frozenset({"PodsStarting", "RollingOut", "PodsOnOlderGeneration", "GenerationNotObserved",
                             "NoReadyPods", "Creating"})
# Announced by an Event of their own when they happen (the refusal, with the field named), not as a transition.
ANNOUNCED_REASONS = frozenset({"SpecRejected", "InvalidSpec"})


# Conditions whose every step has Events of its own (the experiment's ExperimentStarted, ...Promoted): no second one.
OWN_EVENTS = frozenset({"Experiment"})

# Conditions whose False is no harm: no rollout under way, nobody but the operator setting the replicas.
NEUTRAL_TYPES = frozenset({"Progressing", "ReplicasManagedExternally"})


def describe_transitions(
    previous: Iterable[Mapping[str, Any]], current: Iterable[Mapping[str, Any]]
) -> list[EventSpec]:
    """Events for conditions whose status or reason changed. A condition's first appearance as Unknown (or as a
    harmless False: no rollout, nobody but the operator setting the replicas) is not news. Warnings: a known
    problem, or a condition that falls from True to False (pods that were ready and are not any more) unless the
    fall is planned; a service still coming up is Normal."""
    before = {c.get("type"): c for c in previous}
    events = []
    for cond in current:
        if cond["type"] in OWN_EVENTS:
            continue
        old = before.get(cond["type"])
        if old is not None and (old.get("status"), old.get("reason")) == (cond["status"], cond["reason"]):
            continue
        first_quiet = old is None and (cond["status"] == "Unknown"
                                       or (cond["status"] == "False" and cond["type"] in NEUTRAL_TYPES))
        if first_quiet or cond["reason"] in ANNOUNCED_REASONS:
            continue
        degraded = old is not None and old.get("status") == "True" and cond["status"] == "False"
        planned = cond["reason"] in PLANNED_REASONS or cond["type"] in NEUTRAL_TYPES
        problem = cond["reason"] in PROBLEM_REASONS or (degraded and not planned)
        message = f"{cond['type']}={cond['status']}: {cond['message']}"
        events.append(EventSpec(WARNING if problem else NORMAL, cond["reason"], message))
    return events
