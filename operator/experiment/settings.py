"""spec.experiment as plain data: the candidate config, the slice of replicas that serves it, how long it is
measured, and the gates it must pass. operator/spec.py parses the CR into it (defaults = the CRD's; a test holds
the two equal); the autotuner's canary (canary.py) builds one from a proposal.

The candidate names only the scheduler fields that differ (metronome.contract.config's schema, camelCase as in
spec.server); at the start of an experiment they are laid over the config the service serves then, so a chunk the
autotuner chose is kept for every field the candidate leaves out. `prefillBudget` sets the one knob
(metronome.contract.budget) on the candidate's queue policy, as the autotuner does: `{queuePolicy: split,
prefillBudget: 512}` tries split at 512, where `{queuePolicy: split}` alone would serve split's own sizes.
"""
from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Annotated, Any

from pydantic import TypeAdapter, ValidationError
from pydantic.alias_generators import to_camel

from metronome.contract.budget import with_budget
from metronome.contract.config import ConfigError, SchedulerConfig, validate_scheduler
from metronome.operator.spec_error import SpecError

WHERE = "spec.experiment"
# The CRD's camelCase names of the scheduler fields a candidate may set (the server config's schema).
CANDIDATE_FIELDS = {to_camel(name): name for name in SchedulerConfig.model_fields}
PREFILL_BUDGET = "prefillBudget"
CHUNK_FIELDS = ("chunk_size", "short_chunk_size", "long_chunk_size")  # what prefillBudget lays out

# The sign test reaches a one-sided confidence c only with n windows such that 1 - 0.5^n >= c: 5 windows for up to
# 0.96875 (the CRD's bounds: at least 5 windows, confidence at most 0.96).
MIN_WINDOWS = 5
MAX_CONFIDENCE = 0.96


@dataclass(frozen=True)
class CandidateSpec:
    """The scheduler fields the candidate changes (snake_case), and optionally its prefill budget."""

    fields: Mapping[str, Any] = field(default_factory=dict)
    prefill_budget: int | None = None

    def scheduler(self, served: SchedulerConfig) -> SchedulerConfig:
        """The candidate's full scheduler config over the served one. Raises ConfigError naming what is wrong."""
        merged = validate_scheduler({**served.snake_dict(), **self.fields}, source=f"{WHERE}.candidate")
        if self.prefill_budget is None:
            return merged
        return with_budget(merged, self.prefill_budget, merged.queue_policy, source=f"{WHERE}.candidate")

    def as_dict(self) -> dict[str, Any]:
        """camelCase, as in the CRD (what the sweep writes and status shows)."""
        out = {to_camel(name): value for name, value in sorted(self.fields.items())}
        if self.prefill_budget is not None:
            out[PREFILL_BUDGET] = self.prefill_budget
        return out


@dataclass(frozen=True)
class Gates:
    """How much worse than the control the candidate may be (fractions: 0.1 = 10 %)."""

    tbt_p99_worse: float = 0.10
    ttft_p99_worse: float = 0.10
    goodput_lower: float = 0.05
    error_rate: bool = True  # revert on an error rate significantly higher than the control's


@dataclass(frozen=True)
class ExperimentSpec:
    candidate: CandidateSpec
    name: str = ""
    share: int | str = "50%"  # candidate pods: a count, or a percentage of spec.replicas
    window_seconds: int = 60  # None in the CR: spec.metrics.windowSeconds
    windows: int = 10
    confidence: float = 0.95  # of each one-sided bound
    min_improvement: float = 0.05  # "better" means better by at least this fraction
    min_samples: int = 100  # TBT samples each group needs in a window for the window to count
    gates: Gates = field(default_factory=Gates)

    @property
    def duration_seconds(self) -> int:
        return self.window_seconds * self.windows

    @property
    def identity(self) -> str:
        """A short hash of everything that defines the experiment: a change of any of it is a new experiment."""
        text = json.dumps(asdict(self), sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:12]


def candidate_count(share: int | str, replicas: int) -> int | None:
    """Candidate pods for `share` of `replicas`: at least one and never all; None when replicas < 2 (there is no
    slice that leaves a control)."""
    if replicas < 2:
        return None
    if isinstance(share, str):
        wanted = math.floor(replicas * float(share.rstrip("%")) / 100 + 0.5)
    else:
        wanted = share
    return max(1, min(replicas - 1, wanted))


# --- parsing -------------------------------------------------------------------------------------------------


def _number(data: Mapping[str, Any], key: str, kind: type, default: Any, low: float, high: float) -> Any:
    value = data.get(key, default)
    if value is None:
        return default
    kinds = (int,) if kind is int else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise SpecError(f"{WHERE}.{key}: expected {'an integer' if kind is int else 'a number'}, got "
                        f"{type(value).__name__}")
    if not low <= value <= high:
        raise SpecError(f"{WHERE}.{key}: must be within [{low:g}, {high:g}], got {value}")
    return kind(value)


def _percent(data: Mapping[str, Any], key: str, default: float, where: str) -> float:
    value = data.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1000:
        raise SpecError(f"{where}.{key}: a percentage in [0, 1000], got {value!r}")
    return float(value) / 100.0


def _field_check(name: str, value: Any, where: str) -> None:
    """One scheduler field on its own (types and bounds; cross-field rules apply once laid over the served one)."""
    info = SchedulerConfig.model_fields[name]
    try:
        kind = Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation
        TypeAdapter(kind).validate_python(value)
    except ValidationError as exc:
        raise SpecError(f"{where}: {exc.errors()[0]['msg']}") from None


def parse_candidate(data: Any) -> CandidateSpec:
    where = f"{WHERE}.candidate"
    if not isinstance(data, Mapping) or not data:
        raise SpecError(f"{where}: required, the scheduler fields the candidate changes (e.g. chunkSize)")
    fields = {}
    for key, value in data.items():
        if key == PREFILL_BUDGET:
            continue
        name = CANDIDATE_FIELDS.get(key)
        if name is None:
            raise SpecError(f"{where}.{key}: not a reloadable scheduler field (one of "
                            f"{', '.join([*CANDIDATE_FIELDS, PREFILL_BUDGET])})")
        _field_check(name, value, f"{where}.{key}")
        fields[name] = value
    budget = data.get(PREFILL_BUDGET)
    if budget is not None:
        if isinstance(budget, bool) or not isinstance(budget, int) or not 1 <= budget <= 1 << 20:
            raise SpecError(f"{where}.{PREFILL_BUDGET}: a number of tokens in [1, 1048576], got {budget!r}")
        clash = [to_camel(name) for name in CHUNK_FIELDS if name in fields]
        if clash:
            raise SpecError(f"{where}.{PREFILL_BUDGET}: set it or {', '.join(clash)}, not both (it lays the "
                            "budget out on the chunk fields of the candidate's queue policy)")
    return CandidateSpec(fields=fields, prefill_budget=budget)


def _share(value: Any) -> int | str:
    where = f"{WHERE}.share"
    if isinstance(value, bool):
        raise SpecError(f"{where}: a count of pods or a percentage such as 25%, got a boolean")
    if isinstance(value, int):
        if value < 1:
            raise SpecError(f"{where}: at least one pod, got {value}")
        return value
    text = str(value)
    number = text[:-1] if text.endswith("%") else ""
    if not number.isdigit() or not 1 <= int(number) <= 99:
        raise SpecError(f"{where}: a count of pods or a percentage from 1% to 99% (never all), got {value!r}")
    return f"{int(number)}%"


def parse_experiment(data: Any, metrics_window_seconds: int) -> ExperimentSpec | None:
    """spec.experiment (None when absent); `metrics_window_seconds` is the window when it sets none."""
    if data is None:
        return None
    if not isinstance(data, Mapping):
        raise SpecError(f"{WHERE}: expected an object, got {type(data).__name__}")
    defaults = ExperimentSpec(candidate=CandidateSpec())
    name = data.get("name") or ""
    if not isinstance(name, str) or len(name) > 63:
        raise SpecError(f"{WHERE}.name: a string of at most 63 characters, got {name!r}")
    window = _number(data, "windowSeconds", int, metrics_window_seconds, 10, 86400)
    if data.get("windows") is not None and data.get("durationSeconds") is not None:
        raise SpecError(f"{WHERE}: set windows or durationSeconds, not both")
    if data.get("durationSeconds") is not None:
        duration = _number(data, "durationSeconds", int, None, 1, 7 * 86400)
        windows = duration // window
        if windows < MIN_WINDOWS:
            raise SpecError(f"{WHERE}.durationSeconds: {duration} s holds {windows} windows of {window} s; the "
                            f"comparison needs at least {MIN_WINDOWS}")
    else:
        windows = _number(data, "windows", int, defaults.windows, MIN_WINDOWS, 1000)
    gates_data = data.get("gates") or {}
    if not isinstance(gates_data, Mapping):
        raise SpecError(f"{WHERE}.gates: expected an object")
    gates_where = f"{WHERE}.gates"
    default_gates = Gates()
    errors = gates_data.get("errorRate", default_gates.error_rate)
    if not isinstance(errors, bool):
        raise SpecError(f"{gates_where}.errorRate: expected a boolean, got {type(errors).__name__}")
    gates = Gates(
        tbt_p99_worse=_percent(gates_data, "tbtP99WorsePercent", default_gates.tbt_p99_worse, gates_where),
        ttft_p99_worse=_percent(gates_data, "ttftP99WorsePercent", default_gates.ttft_p99_worse, gates_where),
        goodput_lower=_percent(gates_data, "goodputLowerPercent", default_gates.goodput_lower, gates_where),
        error_rate=errors,
    )
    if gates.goodput_lower >= 1:
        raise SpecError(f"{gates_where}.goodputLowerPercent: below 100, got {gates.goodput_lower * 100:g}")
    improvement = _percent(data, "minImprovementPercent", defaults.min_improvement, WHERE)
    if improvement >= 1:
        raise SpecError(f"{WHERE}.minImprovementPercent: below 100, got {improvement * 100:g}")
    return ExperimentSpec(
        candidate=parse_candidate(data.get("candidate")),
        name=name,
        share=_share(data.get("share", defaults.share)),
        window_seconds=window,
        windows=windows,
        confidence=_number(data, "confidence", float, defaults.confidence, 0.5, MAX_CONFIDENCE),
        min_improvement=improvement,
        min_samples=_number(data, "minSamplesPerWindow", int, defaults.min_samples, 1, 1_000_000),
        gates=gates,
    )


def validate_candidate(candidate: CandidateSpec, served: SchedulerConfig) -> tuple[SchedulerConfig | None, str | None]:
    """(the candidate's config, None) or (None, why it cannot run against the served config)."""
    try:
        scheduler = candidate.scheduler(served)
    except ConfigError as exc:
        return None, str(exc)
    if scheduler == served:
        return None, "the candidate is the config the service already serves: there is nothing to compare"
    return scheduler, None
