"""What the tuner is asked to do for one service: `AutotuneSpec` (spec.autotune with the CRD's defaults, the SLO's
targets, the replica bounds, the policy switching returns to) and the controller's fixed constants beside them.
operator/spec.py parses the CR into it; tests/unit/test_crd_schema.py holds its defaults to the CRD's.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from metronome.contract.config import QueuePolicy
from metronome.operator.spec_error import SpecError


class AutotuneMode(str, enum.Enum):
    OFF = "off"  # observe only: status shows TBT and throughput, nothing is decided
    ADVISE = "advise"  # decide and record the proposal, never act
    APPLY = "apply"  # decide and act


class TuningPolicy(str, enum.Enum):
    MODEL = "model"  # fit step time = a + b*tokens, pick the largest chunk predicted to meet the SLO
    MULTIPLICATIVE = "multiplicative"  # the background report's rule: x0.9 when over target, else x1.1


@dataclass(frozen=True)
class AutotuneSpec:
    """Everything the control loop is asked to do: spec.autotune (the fields in spec.AUTOTUNE_FIELDS, defaults =
    the CRD's), the targets of spec.slo, the replica bounds spec.minReplicas/maxReplicas, the policy that switching
    returns to (spec.server.queuePolicy), and the controller's fixed constants (no CRD field). Times in seconds,
    sizes in tokens. `tbt_p99_target_s` is None when spec.slo is absent: the loop then cannot run.

    Deadband: no change while `deadband_low <= tbt_p99 / target <= deadband_high` for the `model` policy (it aims
    at `margin`, inside the band, and acts before the SLO breaks), and while `deadband_low <= ratio <= 1.0` for
    `multiplicative` (the report's rule shrinks only over target). Cap: one decision moves the chunk size at most
    `max_step_up` times up or `max_step_down` times down (x2 / /4 by default: 4096 reaches 256 in two intervals).
    """

    tbt_p99_target_s: float | None = None
    mode: AutotuneMode = AutotuneMode.OFF  # nothing acts unless asked to
    policy: TuningPolicy = TuningPolicy.MODEL
    interval_seconds: float = 30.0
    cooldown_seconds: float = 60.0
    min_chunk: int = 64
    max_chunk: int = 8192
    max_step_up: float = 2.0
    max_step_down: float = 4.0
    margin: float = 0.9  # the model aims at target * margin
    deadband_low: float = 0.7  # wider than the TBT buckets near typical targets (25-30 ms is 17 %)
    deadband_high: float = 0.95
    chunk_granularity: int = 64  # the model's chunk sizes are multiples of this
    policy_switching: bool = True
    scale_replicas: bool = False
    canary: bool = False  # risky moves go through an experiment (operator/experiment/canary.py)
    canary_chunk_change: float = 0.5  # a prefill-budget change above this fraction is risky
    # Scale-down: the replicas that remain must be predicted to carry this × the observed load within the aim, and
    # every recommendation of the last `scale_down_stabilization_seconds` must agree (the HPA's default window).
    scale_down_headroom: float = 1.3
    scale_down_stabilization_seconds: float = 300.0
    # The model keeps prefill throughput ≥ this × the prompt tokens per second: 1.2 held 384-448 on the H200
    # where 256 rode its prefill limit and won on TBT.
    prefill_headroom: float = 1.2
    min_replicas: int = 1
    max_replicas: int = 8
    base_queue_policy: str = QueuePolicy.FCFS.value  # the resource's own policy: where switching returns to
    ttft_p99_target_s: float | None = None
    min_throughput_tokens_per_s: float | None = None
    # The controller's constants.
    multiplicative_down: float = 0.9
    multiplicative_up: float = 1.1
    min_samples: int = 100  # fewer TBT samples in the window = no data
    min_fit_points: int = 4
    min_fit_r2: float = 0.8
    min_fit_token_spread: float = 0.05  # (max - min) / mean tokens per step across fit points
    long_share_on: float = 0.2  # switch to split above this share of long prompts (with TBT over target)
    long_share_off: float = 0.05  # and back below this one: the gap is the hysteresis
    settle_timeout_seconds: float = 300.0  # stop waiting for lagging pods after this long
    queue_growth_limit: float = 5.0  # requests added to the queue over one window that mean prefill lags
    # Without a usable step fit, fewer replicas only while their projected busy share of time stays under this.
    scale_down_max_utilization: float = 0.6

    def __post_init__(self) -> None:
        problems = []
        target = self.tbt_p99_target_s
        if target is not None and not (math.isfinite(target) and target > 0):
            problems.append(f"spec.slo.tbtP99Ms must be positive, got {target * 1000:g} ms")
        if self.min_chunk < 1 or self.max_chunk < self.min_chunk:
            problems.append("spec.autotune chunk bounds need 1 <= minChunkSize <= maxChunkSize, got "
                            f"{self.min_chunk}..{self.max_chunk}")
        if self.min_replicas < 0 or self.max_replicas < self.min_replicas:
            problems.append(f"spec replica bounds need 0 <= minReplicas <= maxReplicas, got "
                            f"{self.min_replicas}..{self.max_replicas}")
        if self.interval_seconds <= 0 or self.cooldown_seconds < 0:
            problems.append("spec.autotune.intervalSeconds must be > 0 and cooldownSeconds >= 0")
        if not 0 < self.margin <= 1:
            problems.append(f"spec.autotune.margin must be in (0, 1], got {self.margin}")
        if not 0 <= self.deadband_low <= self.margin <= self.deadband_high <= 1:
            problems.append(f"spec.autotune needs 0 <= deadbandLow <= margin <= deadbandHigh <= 1, got "
                            f"{self.deadband_low}, {self.margin}, {self.deadband_high}")
        if self.max_step_up < 1 or self.max_step_down < 1:
            problems.append("spec.autotune.maxStepUp and maxStepDown must be >= 1")
        if not 0 < self.multiplicative_down < 1 < self.multiplicative_up:
            problems.append("multiplicative factors need 0 < down < 1 < up")
        if not 0 < self.canary_chunk_change <= 10:
            problems.append(f"spec.autotune.canaryChunkChange must be in (0, 10], got {self.canary_chunk_change}")
        if self.chunk_granularity < 1:
            problems.append("spec.autotune.chunkGranularity must be >= 1")
        if not (math.isfinite(self.prefill_headroom) and 1 <= self.prefill_headroom <= 4):
            problems.append(f"spec.autotune.prefillHeadroom must be in [1, 4], got {self.prefill_headroom}")
        if not (math.isfinite(self.scale_down_headroom) and 1 <= self.scale_down_headroom <= 4):
            problems.append(f"spec.autotune.scaleDownHeadroom must be in [1, 4], got {self.scale_down_headroom}")
        if not self.scale_down_stabilization_seconds >= 0:
            problems.append("spec.autotune.scaleDownStabilizationSeconds must be >= 0")
        if not 0 < self.scale_down_max_utilization <= 1:
            problems.append("scale_down_max_utilization must be in (0, 1]")
        if not 0 <= self.long_share_off <= self.long_share_on <= 1:
            problems.append("long-prompt share thresholds need 0 <= off <= on <= 1")
        if self.base_queue_policy not in {p.value for p in QueuePolicy}:
            problems.append(f"spec.server.queuePolicy: unknown queue policy {self.base_queue_policy!r}")
        for name in ("ttft_p99_target_s", "min_throughput_tokens_per_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                problems.append(f"{name} must be positive when set, got {value}")
        if problems:
            raise SpecError("; ".join(problems))
