"""From the measured windows to a verdict: promote the candidate, revert it, call it no different, or keep
measuring. Pure.

Each window holds both groups over the same interval: the candidate pods and the control pods, read by the same
PromQL with a pod matcher (queries.py). A window counts when each group has `min_samples` token gaps and every
candidate pod contributed (a pod that served nothing would leave the comparison to the others). For TBT p99, TTFT
p99 and goodput per pod, the per-window ratios candidate / control give a median and its distribution-free bounds
at the spec's confidence (stats.median_bounds, the sign test). With `tol` the gate's tolerance and `m` the minimum
improvement, for a latency (lower is better):

- worse:   the lower bound is above 1 + tol (the candidate is worse than allowed, with confidence);
- within:  the upper bound is at most 1 + tol (it is no worse than allowed, with confidence);
- better:  the upper bound is below 1 - m (it is better by at least m, with confidence);

and the mirror image for goodput (higher is better, tol = how much lower it may be). Errors are pooled over the
counted windows (stats.error_rate_p_value). Then, from 5 counted windows on (the fewest that can reach the
CRD's confidences):

1. any gate worse, or errors significantly more frequent → Reverted, at once (the candidate is harming traffic);
2. every gate within and at least one metric better → Promoted, at once;
3. the planned number of windows counted → NoDifference (nothing shown better; the control's config stays);
4. else keep measuring.

Deciding at every window (not only at the end) would inflate a plain significance test's false positives; here a
decision needs the bound beyond a margin (tol or m), and an equal candidate rarely has nearly every window beyond
it, so early decisions cost little and a clearly worse candidate leaves traffic after 5 windows, not the planned N.
"""
from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from metronome.operator.experiment.settings import MIN_WINDOWS, ExperimentSpec
from metronome.operator.experiment.stats import MedianBounds, error_rate_p_value, median_bounds


@dataclass(frozen=True)
class GroupWindow:
    """One group's numbers over one window (None: not measured, e.g. no first token in the window)."""

    tbt_p99_s: float | None
    ttft_p99_s: float | None
    goodput_per_pod: float | None  # tokens within the TBT target (all tokens without an SLO) per pod-second
    tbt_samples: float = 0.0
    requests: float = 0.0
    errors: float = 0.0
    pods_seen: int = 0  # pods of the group with token gaps in the window


@dataclass(frozen=True)
class WindowReading:
    index: int  # 1-based, counted from when every candidate pod served the candidate
    end: float  # Unix time
    candidate: GroupWindow
    control: GroupWindow


@dataclass(frozen=True)
class Metric:
    key: str  # the status key
    label: str  # for people
    lower_is_better: bool
    worse_reason: str  # the Reverted reason when this gate fails

    def value(self, group: GroupWindow) -> float | None:
        return getattr(group, {"tbtP99": "tbt_p99_s", "ttftP99": "ttft_p99_s", "goodput": "goodput_per_pod"}[self.key])


TBT = Metric("tbtP99", "TBT p99", True, "TBTWorse")
TTFT = Metric("ttftP99", "TTFT p99", True, "TTFTWorse")
GOODPUT = Metric("goodput", "goodput per pod", False, "GoodputLower")
METRICS = (TBT, TTFT, GOODPUT)


@dataclass(frozen=True)
class Comparison:
    metric: Metric
    bounds: MedianBounds  # of the ratio candidate / control
    tolerance: float
    min_improvement: float

    @property
    def worse(self) -> bool:
        b = self.bounds
        if self.metric.lower_is_better:
            return b.lower is not None and b.lower > 1 + self.tolerance
        return b.upper is not None and b.upper < 1 - self.tolerance

    @property
    def within(self) -> bool:
        b = self.bounds
        if self.metric.lower_is_better:
            return b.upper is not None and b.upper <= 1 + self.tolerance
        return b.lower is not None and b.lower >= 1 - self.tolerance

    @property
    def better(self) -> bool:
        b = self.bounds
        if self.metric.lower_is_better:
            return b.upper is not None and b.upper < 1 - self.min_improvement
        return b.lower is not None and b.lower > 1 + self.min_improvement

    @property
    def state(self) -> str:
        if self.worse:
            return "worse"
        if self.better:
            return "better"
        return "within" if self.within else "unresolved"

    def describe(self) -> str:
        b = self.bounds
        if b.median is None:
            return f"{self.metric.label}: no windows"
        text = f"{self.metric.label} ratio {b.median:.2f}"
        if b.known:
            text += f" [{b.lower:.2f}, {b.upper:.2f}]"
        return text

    def record(self) -> dict:
        b = self.bounds
        return {"ratio": _round(b.median), "lower": _round(b.lower), "upper": _round(b.upper), "windows": b.n,
                "state": self.state}


@dataclass(frozen=True)
class ErrorComparison:
    candidate_errors: int
    candidate_requests: int
    control_errors: int
    control_requests: int
    p_value: float | None
    confidence: float

    @property
    def candidate_rate(self) -> float | None:
        return self.candidate_errors / self.candidate_requests if self.candidate_requests else None

    @property
    def control_rate(self) -> float | None:
        return self.control_errors / self.control_requests if self.control_requests else None

    @property
    def worse(self) -> bool:
        if self.p_value is None or self.candidate_rate is None or self.control_rate is None:
            return False
        return self.candidate_rate > self.control_rate and self.p_value <= 1 - self.confidence

    def describe(self) -> str:
        return (f"errors {self.candidate_errors}/{self.candidate_requests} vs {self.control_errors}/"
                f"{self.control_requests}")

    def record(self) -> dict:
        return {"candidate": _round(self.candidate_rate, 4), "control": _round(self.control_rate, 4),
                "pValue": _round(self.p_value, 4)}


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(float(value), digits)


class Outcome(str, enum.Enum):
    MEASURING = "Measuring"
    PROMOTED = "Promoted"
    REVERTED = "Reverted"
    NO_DIFFERENCE = "NoDifference"


@dataclass(frozen=True)
class Verdict:
    outcome: Outcome
    reason: str  # CamelCase
    message: str
    counted: int  # windows that counted
    skipped: int  # windows that did not (too few samples, a candidate pod without traffic)
    comparisons: tuple[Comparison, ...] = ()
    errors: ErrorComparison | None = None
    last_problem: str | None = None  # why the last skipped window did not count

    @property
    def decided(self) -> bool:
        return self.outcome is not Outcome.MEASURING

    def ratios(self) -> dict:
        """status.experiment.ratios."""
        out = {c.metric.key: c.record() for c in self.comparisons}
        if self.errors is not None:
            out["errorRate"] = self.errors.record()
        return out

    def summary(self) -> str:
        parts = [c.describe() for c in self.comparisons]
        if self.errors is not None:
            parts.append(self.errors.describe())
        return "; ".join(parts)


def window_problem(window: WindowReading, spec: ExperimentSpec, candidate_pods: int) -> str | None:
    """Why a window cannot count (None: it counts)."""
    for name, group in (("candidate", window.candidate), ("control", window.control)):
        if group.tbt_samples < spec.min_samples:
            return (f"window {window.index}: the {name} pods had {group.tbt_samples:.0f} token gaps, fewer than "
                    f"minSamplesPerWindow {spec.min_samples}")
    if window.candidate.pods_seen < candidate_pods:
        return (f"window {window.index}: {window.candidate.pods_seen} of {candidate_pods} candidate pods served "
                "traffic")
    return None


def _ratios(metric: Metric, windows: Sequence[WindowReading]) -> list[float]:
    out = []
    for window in windows:
        candidate, control = metric.value(window.candidate), metric.value(window.control)
        if candidate is not None and control is not None and candidate > 0 and control > 0:
            out.append(candidate / control)
    return out


def compare(windows: Sequence[WindowReading], spec: ExperimentSpec) -> tuple[tuple[Comparison, ...], ErrorComparison]:
    tolerances = {TBT.key: spec.gates.tbt_p99_worse, TTFT.key: spec.gates.ttft_p99_worse,
                  GOODPUT.key: spec.gates.goodput_lower}
    comparisons = tuple(Comparison(m, median_bounds(_ratios(m, windows), spec.confidence), tolerances[m.key],
                                   spec.min_improvement) for m in METRICS)
    counts = [int(round(sum(getattr(getattr(w, group), field) for w in windows)))
              for group in ("candidate", "control") for field in ("errors", "requests")]
    errors = ErrorComparison(*counts, p_value=error_rate_p_value(*counts), confidence=spec.confidence)
    return comparisons, errors


def judge(windows: Sequence[WindowReading], spec: ExperimentSpec, candidate_pods: int) -> Verdict:
    """The verdict after `windows` (every complete window so far, in order)."""
    problems = [window_problem(w, spec, candidate_pods) for w in windows]
    counted = [w for w, problem in zip(windows, problems, strict=True) if problem is None]
    skipped = [problem for problem in problems if problem is not None]
    last_problem = skipped[-1] if skipped else None
    comparisons, errors = compare(counted, spec)
    n = len(counted)

    def verdict(outcome: Outcome, reason: str, message: str) -> Verdict:
        return Verdict(outcome, reason, message, n, len(skipped), comparisons, errors, last_problem)

    progress = f"{n}/{spec.windows} windows"
    if n < MIN_WINDOWS:
        return verdict(Outcome.MEASURING, "Measuring", f"{progress} counted")
    worse = [c for c in comparisons if c.worse]
    if worse:
        reason = worse[0].metric.worse_reason
        allowed = ", ".join(f"{c.describe()}, worse than the {'+' if c.metric.lower_is_better else '-'}"
                            f"{c.tolerance * 100:g} % allowed" for c in worse)
        return verdict(Outcome.REVERTED, reason, f"{allowed}, after {progress}")
    if spec.gates.error_rate and errors.worse:
        return verdict(Outcome.REVERTED, "ErrorRateHigher",
                       f"{errors.describe()} (p = {errors.p_value:.3f}) after {progress}")
    better = [c for c in comparisons if c.better]
    if better and all(c.within for c in comparisons):
        gains = ", ".join(c.describe() for c in better)
        return verdict(Outcome.PROMOTED, "Better", f"{gains}; every gate within its tolerance after {progress}")
    if n >= spec.windows:
        unresolved = [c.metric.label for c in comparisons if not c.within]
        detail = f"; not shown within tolerance: {', '.join(unresolved)}" if unresolved else ""
        return verdict(Outcome.NO_DIFFERENCE, "NoDifference",
                       f"no metric better by {spec.min_improvement * 100:g} % or more and none worse than allowed "
                       f"after {progress}{detail}: the control's config stays")
    return verdict(Outcome.MEASURING, "Measuring", f"{progress} counted")
