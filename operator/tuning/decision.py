"""The controller's other input and its output, as plain data: what is deployed now (CurrentConfig) and what to do
next (Decision). No I/O here."""
from __future__ import annotations

import enum
from dataclasses import dataclass

from metronome.contract.budget import prefill_budget
from metronome.contract.config import QueuePolicy, SchedulerConfig


class ActionKind(str, enum.Enum):
    HOLD = "hold"
    NO_DATA = "no_data"
    CHUNK_DOWN = "chunk_down"
    CHUNK_UP = "chunk_up"
    POLICY_SWITCH = "policy_switch"
    SCALE_UP = "scale_up"
    SCALE_DOWN = "scale_down"
    SLO_UNREACHABLE = "slo_unreachable"


@dataclass(frozen=True)
class CurrentConfig:
    """What the operator last wrote (the ConfigMap's scheduler fields and generation, the Deployment's replicas).

    `chunk_size` is the step's prefill budget, the one knob the controller tunes: `chunk_size` under fcfs and
    sjf, max(short_chunk_size, long_chunk_size) under split (metronome.contract.budget, which also lays a new
    budget out: actuation.scheduler_for).
    """

    chunk_size: int
    queue_policy: str
    replicas: int
    generation: int = 0
    last_change_time: float | None = None  # seconds since the epoch; None = never changed by the controller
    short_prompt_threshold: int = 512  # split admits short prompts whole, so its budget never goes below this
    # Who else sets the replica count (e.g. "HorizontalPodAutoscaler web/llm"): the loop then never changes it.
    replicas_owner: str | None = None
    # The most requests a server runs at once (max_num_seqs); past it requests wait whole for a slot. None: unknown.
    max_num_seqs: int | None = None

    @classmethod
    def from_scheduler(cls, scheduler: SchedulerConfig, replicas: int, generation: int = 0,
                       last_change_time: float | None = None, replicas_owner: str | None = None) -> CurrentConfig:
        return cls(prefill_budget(scheduler), QueuePolicy(scheduler.queue_policy).value, replicas, generation,
                   last_change_time, scheduler.short_prompt_threshold, replicas_owner, scheduler.max_num_seqs)


@dataclass(frozen=True)
class Decision:
    """What the controller wants: target values (equal to the current ones when nothing changes) and why.

    `changed` means "act on it now". In advise mode `changed` is False, `advisory` is True and
    `proposed_change` tells whether the recorded values differ from the current ones.
    """

    chunk_size: int
    queue_policy: str
    replicas: int
    reason: str
    changed: bool
    actions: tuple[ActionKind, ...] = (ActionKind.HOLD,)
    policy_used: str = "none"  # "model", "multiplicative", "policy-switch", "scale" or "none"
    advisory: bool = False
    proposed_change: bool = False
    slo_unreachable: bool = False
    metrics_available: bool = True
    slo_met: bool | None = None  # None = unknown (no data)
    tbt_ratio: float | None = None  # observed p99 TBT / target
    predicted_tbt_p99_s: float | None = None
    fit_r_squared: float | None = None
    # What the observed load needs with the scale-down headroom, within the bounds (None: this reading was not
    # judged: no data, settling). The caller keeps these for the scale-down's stabilization window.
    recommended_replicas: int | None = None

    def describe_change(self, current: CurrentConfig) -> str:
        """'chunk 4096→1024, policy fcfs→split, replicas 1→2' (only what differs), or 'no change'."""
        parts = []
        if self.chunk_size != current.chunk_size:
            parts.append(f"chunk {current.chunk_size}→{self.chunk_size}")
        if self.queue_policy != current.queue_policy:
            parts.append(f"policy {current.queue_policy}→{self.queue_policy}")
        if self.replicas != current.replicas:
            parts.append(f"replicas {current.replicas}→{self.replicas}")
        return ", ".join(parts) or "no change"
