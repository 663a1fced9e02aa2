"""The controller's inputs and output as plain data: what Prometheus saw (Observation), what is deployed
(CurrentConfig), what the resource asks for (AutotuneSpec) and what to do next (Decision).

No I/O here. `AutotuneSpec.from_resource_spec` reads the camelCase `spec` of an InferenceService.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

from metronome.contract.config import ConfigError, QueuePolicy, SchedulerConfig, validate_scheduler
from metronome.contract.errors import MetronomeError

if TYPE_CHECKING:  # the operator's parsed CR; only its attributes are read
    from metronome.operator.spec import InferenceServiceSpec


class AutotuneSpecError(MetronomeError, ValueError):
    """The autotune/SLO part of a resource cannot be used; the message names the field."""


class AutotuneMode(str, enum.Enum):
    OFF = "off"  # observe only: status shows TBT and throughput, nothing is decided
    ADVISE = "advise"  # decide and record the proposal, never act
    APPLY = "apply"  # decide and act


class TuningPolicy(str, enum.Enum):
    MODEL = "model"  # fit step time = a + b*tokens, pick the largest chunk predicted to meet the SLO
    MULTIPLICATIVE = "multiplicative"  # the background report's rule: x0.9 when over target, else x1.1


class ActionKind(str, enum.Enum):
    HOLD = "hold"
    NO_DATA = "no_data"
    CHUNK_DOWN = "chunk_down"
    CHUNK_UP = "chunk_up"
    POLICY_SWITCH = "policy_switch"
    SCALE_UP = "scale_up"
    SLO_UNREACHABLE = "slo_unreachable"


@dataclass(frozen=True)
class StepSample:
    """Mean tokens per step and mean step time of one pod over one sub-window (weight = steps in it)."""

    tokens_per_step: float
    step_seconds: float
    steps: float = 1.0
    pod: str = ""


@dataclass(frozen=True)
class Observation:
    """One service over one window, as Prometheus saw it. Optional fields are None when not measured."""

    window_seconds: float
    sample_count: int  # TBT samples (token gaps) in the window, all pods together
    tbt_p99_s: float | None
    output_tokens_per_s: float = 0.0
    ttft_p99_s: float | None = None
    tbt_mean_s: float | None = None
    prompt_tokens_per_s: float | None = None
    requests_per_s: float | None = None  # finished requests per second (request_e2e count rate)
    mean_prompt_tokens: float | None = None
    long_prompt_share: float | None = None  # share of requests with long prompts (see metrics_source for the proxy)
    short_tbt_p99_s: float | None = None  # p99 TBT of short-prompt requests, when the server splits it out
    long_tbt_p99_s: float | None = None
    waiting_by_queue: Mapping[str, float] = field(default_factory=dict)
    decode_batch_size: float | None = None  # mean running sequences per pod
    step_samples: tuple[StepSample, ...] = ()
    pod_generations: Mapping[str, int] = field(default_factory=dict)

    @property
    def waiting_total(self) -> float:
        return float(sum(self.waiting_by_queue.values()))

    def pods_on_generation(self, generation: int) -> int:
        return sum(1 for g in self.pod_generations.values() if g >= generation)


@dataclass(frozen=True)
class CurrentConfig:
    """What the operator last wrote (the ConfigMap's scheduler fields and generation, the Deployment's replicas).

    `chunk_size` is the step's prefill budget, the one knob the controller tunes: `chunk_size` under fcfs and
    sjf, max(short_chunk_size, long_chunk_size) under split (see `prefill_budget`, `scheduler_for`).
    """

    chunk_size: int
    queue_policy: str
    replicas: int
    generation: int = 0
    last_change_time: float | None = None  # seconds since the epoch; None = never changed by the controller
    short_prompt_threshold: int = 512  # split admits short prompts whole, so its budget never goes below this

    @classmethod
    def from_scheduler(cls, scheduler: SchedulerConfig, replicas: int, generation: int = 0,
                       last_change_time: float | None = None) -> "CurrentConfig":
        return cls(prefill_budget(scheduler), QueuePolicy(scheduler.queue_policy).value, replicas, generation,
                   last_change_time, scheduler.short_prompt_threshold)


def prefill_budget(scheduler: SchedulerConfig) -> int:
    """Prefill tokens one step may carry under the served policy (what bounds a step's length)."""
    if QueuePolicy(scheduler.queue_policy) is QueuePolicy.SPLIT:
        return max(scheduler.short_chunk_size, scheduler.long_chunk_size)
    return scheduler.chunk_size


def scheduler_for(decision: "Decision", served: SchedulerConfig) -> SchedulerConfig:
    """The scheduler config that carries out a decision: its budget lands on the fields its policy reads
    (split: long prompts advance by the budget, short ones are admitted whole within max(budget, threshold)).
    `chunk_size` always holds the budget, so switching policy keeps it. Other fields stay as served."""
    fields = {**served.snake_dict(), "queue_policy": decision.queue_policy, "chunk_size": decision.chunk_size}
    if QueuePolicy(decision.queue_policy) is QueuePolicy.SPLIT:
        fields["long_chunk_size"] = decision.chunk_size
        fields["short_chunk_size"] = max(decision.chunk_size, served.short_prompt_threshold)
    try:
        return validate_scheduler(fields, source="decision")
    except ConfigError as exc:
        raise AutotuneSpecError(f"the decision does not make a valid scheduler config: {exc}") from exc


@dataclass(frozen=True)
class AutotuneSpec:
    """Targets and limits of the control loop. Times in seconds, sizes in tokens.

    Deadband: no change while `deadband_low <= tbt_p99 / target <= deadband_high` for the `model` policy (it aims
    at `margin`, inside the band, and acts before the SLO breaks), and while `deadband_low <= ratio <= 1.0` for
    `multiplicative` (the report's rule shrinks only over target). Cap: one decision moves the chunk size at most `max_step_up` times up or
    `max_step_down` times down (x2 / /4 by default: 4096 reaches 256 in two intervals).
    """

    tbt_p99_target_s: float
    mode: AutotuneMode = AutotuneMode.OFF  # as the CRD: nothing acts unless asked to
    policy: TuningPolicy = TuningPolicy.MODEL
    interval_seconds: float = 30.0
    min_chunk: int = 64
    max_chunk: int = 8192
    cooldown_seconds: float = 60.0
    policy_switching: bool = True
    scale_replicas: bool = False
    min_replicas: int = 1
    max_replicas: int = 8
    base_queue_policy: str = QueuePolicy.FCFS.value  # the resource's own policy: where switching returns to
    ttft_p99_target_s: float | None = None
    min_throughput_tokens_per_s: float | None = None
    margin: float = 0.9  # the model aims at target * margin
    deadband_low: float = 0.7  # wider than the TBT buckets near typical targets (25-30 ms is 17 %)
    deadband_high: float = 0.95
    max_step_up: float = 2.0
    max_step_down: float = 4.0
    chunk_granularity: int = 64  # the model's chunk sizes are multiples of this
    multiplicative_down: float = 0.9
    multiplicative_up: float = 1.1
    min_samples: int = 100  # fewer TBT samples in the window = no data
    min_fit_points: int = 4
    min_fit_r2: float = 0.8
    min_fit_token_spread: float = 0.05  # (max - min) / mean tokens per step across fit points
    long_share_on: float = 0.2  # switch to split above this share of long prompts (with TBT over target)
    long_share_off: float = 0.05  # and back below this one: the gap is the hysteresis
    settle_timeout_seconds: float = 300.0  # stop waiting for lagging pods after this long

    def __post_init__(self) -> None:
        problems = []
        if not (math.isfinite(self.tbt_p99_target_s) and self.tbt_p99_target_s > 0):
            problems.append(f"slo.tbtP99Ms must be positive, got {self.tbt_p99_target_s * 1000:g} ms")
        if self.min_chunk < 1 or self.max_chunk < self.min_chunk:
            problems.append(f"autotune chunk bounds need 1 <= minChunkSize <= maxChunkSize, got {self.min_chunk}..{self.max_chunk}")
        if self.min_replicas < 0 or self.max_replicas < self.min_replicas:
            problems.append(f"replica bounds need 0 <= min <= max, got {self.min_replicas}..{self.max_replicas}")
        if self.interval_seconds <= 0 or self.cooldown_seconds < 0:
            problems.append("autotune.intervalSeconds must be > 0 and cooldownSeconds >= 0")
        if not 0 < self.margin <= 1:
            problems.append(f"margin must be in (0, 1], got {self.margin}")
        if not 0 <= self.deadband_low <= self.margin <= self.deadband_high <= 1:
            problems.append(f"need 0 <= deadband_low <= margin <= deadband_high <= 1, got {self.deadband_low}, "
                            f"{self.margin}, {self.deadband_high}")
        if self.max_step_up < 1 or self.max_step_down < 1:
            problems.append("max_step_up and max_step_down must be >= 1")
        if not 0 < self.multiplicative_down < 1 < self.multiplicative_up:
            problems.append("multiplicative factors need 0 < down < 1 < up")
        if self.chunk_granularity < 1:
            problems.append("chunk_granularity must be >= 1")
        if not 0 <= self.long_share_off <= self.long_share_on <= 1:
            problems.append("long-prompt share thresholds need 0 <= off <= on <= 1")
        if self.base_queue_policy not in {p.value for p in QueuePolicy}:
            problems.append(f"unknown queue policy {self.base_queue_policy!r}")
        for name in ("ttft_p99_target_s", "min_throughput_tokens_per_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                problems.append(f"{name} must be positive when set, got {value}")
        if problems:
            raise AutotuneSpecError("; ".join(problems))

    @classmethod
    def from_resource_spec(cls, spec: Mapping[str, Any]) -> "AutotuneSpec":
        """Read an InferenceService `spec` (camelCase, as in crds/inferenceservice.yaml). Fields read:

        slo.tbtP99Ms (required), slo.ttftP99Ms, slo.minThroughputTokensPerSecond;
        autotune.{mode, policy, intervalSeconds, minChunkSize, maxChunkSize, cooldownSeconds, policySwitching,
        scaleReplicas, margin, deadbandLow, deadbandHigh, maxStepUp, maxStepDown, chunkGranularity};
        minReplicas, maxReplicas; server.queuePolicy (the policy that switching returns to).
        Absent fields take the CRD's defaults, which are this class's (mode off, policySwitching true, ...).
        """
        if not isinstance(spec, Mapping):
            raise AutotuneSpecError(f"spec must be a mapping, got {type(spec).__name__}")
        slo = _section(spec, "slo")
        autotune = _section(spec, "autotune")
        server = _section(spec, "server")
        if "tbtP99Ms" not in slo:
            raise AutotuneSpecError("spec.slo.tbtP99Ms is required for autotuning")
        kwargs: dict[str, Any] = {
            "tbt_p99_target_s": _number(slo, "tbtP99Ms", "spec.slo.tbtP99Ms", float) / 1000.0,
            "min_replicas": _number(spec, "minReplicas", "spec.minReplicas", int, 1),
            "max_replicas": _number(spec, "maxReplicas", "spec.maxReplicas", int, 8),
        }
        if "ttftP99Ms" in slo:
            kwargs["ttft_p99_target_s"] = _number(slo, "ttftP99Ms", "spec.slo.ttftP99Ms", float) / 1000.0
        if "minThroughputTokensPerSecond" in slo:
            kwargs["min_throughput_tokens_per_s"] = _number(
                slo, "minThroughputTokensPerSecond", "spec.slo.minThroughputTokensPerSecond", float)
        if "mode" in autotune:
            kwargs["mode"] = _enum(AutotuneMode, autotune["mode"], "spec.autotune.mode")
        if "policy" in autotune:
            kwargs["policy"] = _enum(TuningPolicy, autotune["policy"], "spec.autotune.policy")
        numeric = {
            "intervalSeconds": ("interval_seconds", float), "minChunkSize": ("min_chunk", int),
            "maxChunkSize": ("max_chunk", int), "cooldownSeconds": ("cooldown_seconds", float),
            "margin": ("margin", float), "deadbandLow": ("deadband_low", float),
            "deadbandHigh": ("deadband_high", float),
            "maxStepUp": ("max_step_up", float), "maxStepDown": ("max_step_down", float),
            "chunkGranularity": ("chunk_granularity", int),
        }
        for key, (name, kind) in numeric.items():
            if key in autotune:
                kwargs[name] = _number(autotune, key, f"spec.autotune.{key}", kind)
        for key, name in (("policySwitching", "policy_switching"), ("scaleReplicas", "scale_replicas")):
            if key in autotune:
                if not isinstance(autotune[key], bool):
                    raise AutotuneSpecError(f"spec.autotune.{key} must be true or false, got {autotune[key]!r}")
                kwargs[name] = autotune[key]
        policy = server.get("queuePolicy", server.get("queue_policy"))
        if policy is not None:
            kwargs["base_queue_policy"] = _enum(QueuePolicy, policy, "spec.server.queuePolicy").value
        return cls(**kwargs)

    @classmethod
    def from_service(cls, service: "InferenceServiceSpec") -> "AutotuneSpec":
        """From the operator's parsed spec (metronome.operator.spec.InferenceServiceSpec)."""
        if service.slo is None:
            raise AutotuneSpecError("spec.slo.tbtP99Ms is required for autotuning")
        tune, slo = service.autotune, service.slo
        return cls(
            tbt_p99_target_s=slo.tbt_p99_ms / 1000.0,
            ttft_p99_target_s=slo.ttft_p99_ms / 1000.0 if slo.ttft_p99_ms is not None else None,
            min_throughput_tokens_per_s=slo.min_throughput_tokens_per_second,
            mode=_enum(AutotuneMode, tune.mode, "spec.autotune.mode"),
            policy=_enum(TuningPolicy, tune.policy, "spec.autotune.policy"),
            interval_seconds=float(tune.interval_seconds), cooldown_seconds=float(tune.cooldown_seconds),
            min_chunk=tune.min_chunk_size, max_chunk=tune.max_chunk_size,
            max_step_up=tune.max_step_up, max_step_down=tune.max_step_down, margin=tune.margin,
            deadband_low=tune.deadband_low, deadband_high=tune.deadband_high,
            chunk_granularity=tune.chunk_granularity, policy_switching=tune.policy_switching,
            scale_replicas=tune.scale_replicas, min_replicas=service.min_replicas,
            max_replicas=service.max_replicas, base_queue_policy=QueuePolicy(service.server.queue_policy).value,
        )


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


def _section(spec: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = spec.get(key) or {}
    if not isinstance(value, Mapping):
        raise AutotuneSpecError(f"spec.{key} must be a mapping, got {type(value).__name__}")
    return value


def _number(section: Mapping[str, Any], key: str, where: str, kind: type, default: Any = None) -> Any:
    if key not in section or section[key] is None:
        if default is None:
            raise AutotuneSpecError(f"{where} is required")
        return default
    value = section[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise AutotuneSpecError(f"{where} must be a number, got {value!r}")
    if kind is int and value != int(value):
        raise AutotuneSpecError(f"{where} must be a whole number, got {value!r}")
    return kind(value)


def _enum(kind: type[enum.Enum], value: Any, where: str) -> Any:
    try:
        return kind(value)
    except ValueError:
        allowed = ", ".join(m.value for m in kind)
        raise AutotuneSpecError(f"{where} must be one of {allowed}, got {value!r}") from None
