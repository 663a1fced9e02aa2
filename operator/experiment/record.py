"""status.experiment: what the operator knows of a service's experiment, as plain data and as the CR stores it.

The record is the experiment's memory between readings and across operator restarts: which pods it made
candidates, which generations each side serves, since when it measures, and how it ended. Windows are not kept:
every reading asks Prometheus for all of them again (queries.py), so a restarted operator, or a new leader,
continues where the last one stopped.
"""
from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

SPEC, AUTOTUNE = "spec", "autotune"  # where an experiment comes from: spec.experiment, or autotune's canary


class Phase(str, enum.Enum):
    PENDING = "Pending"  # waiting for replicas, ready pods and a settled config
    STARTING = "Starting"  # candidate pods labelled, waiting for them to serve the candidate config
    RUNNING = "Running"  # measuring
    PROMOTED = "Promoted"
    REVERTED = "Reverted"
    NO_DIFFERENCE = "NoDifference"
    ABORTED = "Aborted"


ACTIVE = frozenset({Phase.PENDING, Phase.STARTING, Phase.RUNNING})


@dataclass(frozen=True)
class Record:
    id: str  # the experiment's identity (ExperimentSpec.identity)
    source: str  # SPEC or AUTOTUNE
    phase: Phase
    reason: str
    message: str
    name: str = ""
    candidate: Mapping[str, Any] | None = None  # the candidate's whole scheduler config (camelCase), from the start
    candidate_pods: tuple[str, ...] = ()
    candidate_generation: int | None = None
    control_generation: int | None = None
    started_at: float | None = None
    measuring_since: float | None = None
    decided_at: float | None = None
    windows: int = 0  # counted so far
    windows_planned: int = 0
    windows_skipped: int = 0
    ratios: Mapping[str, Any] = field(default_factory=dict)

    @property
    def active(self) -> bool:
        return self.phase in ACTIVE

    @property
    def summary(self) -> str:
        """The EXPERIMENT column."""
        if self.phase is Phase.RUNNING:
            return f"Running {self.windows}/{self.windows_planned}"
        return self.phase.value

    def but(self, **changes: Any) -> Record:
        return replace(self, **changes)

    def to_status(self, format_time) -> dict[str, Any]:
        """The CR's status.experiment (`format_time`: epoch seconds → RFC 3339), every key present (None where the
        record has no value)."""

        def when(value: float | None) -> str | None:
            return format_time(value) if value is not None else None

        out = {
            "id": self.id, "source": self.source, "name": self.name or None, "phase": self.phase.value,
            "reason": self.reason, "message": self.message, "summary": self.summary,
            "candidate": dict(self.candidate) if self.candidate is not None else None,
            "candidatePods": list(self.candidate_pods) or None,
            "candidateGeneration": self.candidate_generation, "controlGeneration": self.control_generation,
            "startedAt": when(self.started_at), "measuringSince": when(self.measuring_since),
            "decidedAt": when(self.decided_at), "windows": self.windows, "windowsPlanned": self.windows_planned,
            "windowsSkipped": self.windows_skipped, "ratios": dict(self.ratios) or None,
        }
        return out  # None = absent: as a merge patch it also removes what an earlier experiment left


def record_from_status(data: Any, parse_time) -> Record | None:
    """status.experiment → Record (None when absent or unreadable: a record the operator cannot read is one it
    did not write, and a new experiment starts afresh)."""
    if not isinstance(data, Mapping) or not data.get("id"):
        return None
    try:
        phase = Phase(data.get("phase"))
    except ValueError:
        return None

    def integer(key: str) -> int | None:
        value = data.get(key)
        return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    return Record(
        id=str(data["id"]), source=str(data.get("source") or SPEC), phase=phase, reason=str(data.get("reason") or ""),
        message=str(data.get("message") or ""), name=str(data.get("name") or ""),
        candidate=data.get("candidate") if isinstance(data.get("candidate"), Mapping) else None,
        candidate_pods=tuple(str(p) for p in data.get("candidatePods") or ()),
        candidate_generation=integer("candidateGeneration"), control_generation=integer("controlGeneration"),
        started_at=parse_time(data.get("startedAt")), measuring_since=parse_time(data.get("measuringSince")),
        decided_at=parse_time(data.get("decidedAt")), windows=integer("windows") or 0,
        windows_planned=integer("windowsPlanned") or 0, windows_skipped=integer("windowsSkipped") or 0,
        ratios=data.get("ratios") if isinstance(data.get("ratios"), Mapping) else {},
    )
