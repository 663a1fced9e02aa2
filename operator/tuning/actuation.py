"""From a reading to what the servers are told to serve: the operator's one step for one service, pure.

`tune` reads the served config as the controller sees it (its prefill budget, metronome.contract.budget), runs the
controller, and lays a changed budget or policy out as the next server.yaml generation. The operator's control
loop (through autotune.step) and `metronome bench loop` both call it, so the loop on real servers is the
operator's own.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from metronome.contract.budget import with_budget
from metronome.contract.config import ConfigError, SchedulerConfig, ServerConfigFile, next_server_config
from metronome.operator.tuning.controller import decide
from metronome.operator.tuning.decision import CurrentConfig, Decision
from metronome.operator.tuning.observation import Observation
from metronome.operator.tuning.replicas import Recommendation
from metronome.operator.tuning.settings import AutotuneSpec


@dataclass(frozen=True)
class Tuned:
    """One step's outcome: what was served (as the controller read it), the decision, and the server.yaml that
    carries out a changed budget or policy (None: serve on as before, also when the decision lays out as the
    config already served). `problem`: why a decision to change them
    cannot be laid out as a valid config (then `config` is None)."""

    current: CurrentConfig
    decision: Decision
    config: ServerConfigFile | None = None
    problem: str | None = None


def scheduler_for(decision: Decision, served: SchedulerConfig) -> SchedulerConfig:
    """The scheduler config that carries out a decision: its budget laid out on the fields its policy reads
    (metronome.contract.budget.with_budget), every other field as served. Raises ConfigError."""
    return with_budget(served, decision.chunk_size, decision.queue_policy, source="the decision")


def tune(observation: Observation | None, served: ServerConfigFile, replicas: int, spec: AutotuneSpec, now: float,
         last_change_time: float | None = None, recent: Sequence[Recommendation] = (),
         replicas_owner: str | None = None) -> Tuned:
    """One step for one service: `observation` None when there is no reading; `last_change_time` when the loop
    last changed something (None: never); `recent` the earlier readings' replica recommendations;
    `replicas_owner` who else sets the replica count (an HPA, a ScaledObject; None: the loop may). Raises SpecError
    when the spec cannot be tuned by (no SLO)."""
    current = CurrentConfig.from_scheduler(served.scheduler, replicas, served.generation, last_change_time,
                                           replicas_owner)
    decision = decide(observation, current, spec, now, recent)
    if not decision.changed or (decision.chunk_size, decision.queue_policy) == (current.chunk_size,
                                                                               current.queue_policy):
        return Tuned(current, decision)
    try:
        scheduler = scheduler_for(decision, served.scheduler)
    except ConfigError as exc:
        return Tuned(current, decision, problem=f"decision {decision.describe_change(current)} not applied: {exc}")
    config = next_server_config(served, scheduler)
    return Tuned(current, decision, config if config is not served else None)
