"""The autotuner's riskier moves through an experiment (`spec.autotune.canary: true`): the tuner proposes, the
experiment decides. Pure.

Risky: a queue-policy switch, or a prefill-budget change larger than `spec.autotune.canaryChunkChangePercent`
(metronome.contract.budget's one number, before and after). Such a move is not written to server.yaml; it becomes
the candidate of an experiment (source "autotune") on a slice of the pods, with the default gates, the service's
metrics window, and the defaults of spec.experiment otherwise. Small steps still go straight to every pod: they
are what the tuner's own settling and cooldown are for.

After a canary ends the tuner waits out its cooldown from the decision, and does not propose a candidate that was
just reverted (or showed no difference) again for HOLD_OFF_COOLDOWNS cooldowns: the same reading would otherwise
propose the same move at once, and the slice would flip back and forth.
"""
from __future__ import annotations

from dataclasses import dataclass

from metronome.contract.budget import prefill_budget
from metronome.contract.config import SchedulerConfig, validate_scheduler
from metronome.operator.experiment.lifecycle import Wanted, scheduler_record
from metronome.operator.experiment.record import AUTOTUNE, Phase, Record
from metronome.operator.experiment.settings import CandidateSpec, ExperimentSpec

HOLD_OFF_COOLDOWNS = 10


@dataclass(frozen=True)
class CanarySpec:
    """spec.autotune's canary fields."""

    enabled: bool = False
    chunk_change: float = 0.5  # a budget change above this fraction of the current budget is risky


def risk(current: SchedulerConfig, proposed: SchedulerConfig, chunk_change: float) -> str | None:
    """Why a move is risky enough for an experiment (None: apply it directly)."""
    if proposed.queue_policy != current.queue_policy:
        return f"a queue-policy switch ({current.queue_policy.value} -> {proposed.queue_policy.value})"
    before, after = prefill_budget(current), prefill_budget(proposed)
    change = abs(after - before) / before
    if change > chunk_change:
        return f"a prefill-budget change of {change * 100:.0f} % ({before} -> {after})"
    return None


def canary_wanted(proposed: SchedulerConfig, window_seconds: int, min_samples: int) -> Wanted:
    """The experiment that tries `proposed` (the whole config, so it does not depend on what is served then)."""
    spec = ExperimentSpec(candidate=CandidateSpec(fields=proposed.snake_dict()), name="autotune",
                          window_seconds=window_seconds, min_samples=min_samples)
    return Wanted(spec, AUTOTUNE)


def running_canary(record: Record | None, window_seconds: int, min_samples: int) -> Wanted | None:
    """The canary a record in progress is about (rebuilt from the candidate it stores), None when there is none."""
    if record is None or record.source != AUTOTUNE or not record.active or record.candidate is None:
        return None
    proposed = validate_scheduler(dict(record.candidate), source="status.experiment.candidate")
    wanted = canary_wanted(proposed, window_seconds, min_samples)
    return wanted if wanted.id == record.id else None


def held_off(record: Record | None, proposed: SchedulerConfig, now: float, cooldown_seconds: float) -> str | None:
    """Why the tuner must not start a canary for `proposed` now (None: it may)."""
    if record is None or record.source != AUTOTUNE or record.decided_at is None:
        return None
    since = now - record.decided_at
    if since < cooldown_seconds:
        return f"cooling down after the last canary ({record.phase.value}, {since:.0f} s ago)"
    rejected = record.phase in (Phase.REVERTED, Phase.NO_DIFFERENCE, Phase.ABORTED)
    if rejected and record.candidate == scheduler_record(proposed) and since < HOLD_OFF_COOLDOWNS * cooldown_seconds:
        return f"the same candidate ended {record.phase.value} {since:.0f} s ago"
    return None
