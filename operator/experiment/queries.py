"""The PromQL of an experiment's windows and its results as WindowReadings. Pure (source.py runs the queries).

Both groups are read by the same queries over the same windows; only a matcher on the `pod` label differs: the
candidate pods by name (`pod=~"a|b"`), the control as every other pod of the service (`pod!~"a|b"`, so a control
pod that a scale-up adds is counted too). The pod names come from the API (the pods the operator labelled), the
label contract is the metrics source's (metrics_source.ServiceSelector: namespace, model, pod), so the same scrape
setups work unchanged, and the series of a pod keep their identity while it switches configs.

Window k (1-based) covers (since + (k-1)·w, since + k·w]; one range query per expression, evaluated at the windows'
ends with a step of w, reads every window at once. Per group and window:
- TBT and TTFT p99: histogram_quantile over the group's summed bucket increases;
- token gaps per pod (how many TBT samples each pod contributed: the window counts only with every candidate pod);
- goodput per pod: token gaps within the SLO's TBT target (the largest histogram bound at or below it) per
  pod-second, read from the per-pod bucket increases; without an SLO, output tokens per pod-second;
- requests (first tokens emitted) and errors (requests turned away as overloaded: what a scheduler config can
  cause; a client's own mistakes and a draining pod are not the config's).
"""
from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from metronome.contract import metric_names as names
from metronome.operator.experiment.verdict import GroupWindow, WindowReading
from metronome.operator.metrics_source import ServiceSelector, format_duration

TBT_P99 = "tbt_p99"
TTFT_P99 = "ttft_p99"
GAPS_BY_POD = "gaps_by_pod"
TBT_BUCKETS_BY_POD = "tbt_buckets_by_pod"
TOKENS_BY_POD = "tokens_by_pod"
REQUESTS = "requests"
ERRORS = "errors"
QUERY_KEYS = (TBT_P99, TTFT_P99, GAPS_BY_POD, TBT_BUCKETS_BY_POD, TOKENS_BY_POD, REQUESTS, ERRORS)
GROUPS = ("candidate", "control")
ERROR_REASONS = ("overloaded",)  # of metric_names.REQUESTS_REJECTED's reasons: the ones a config can cause


class QueryError(ValueError):
    """A range query's result is not what the queries ask for."""


@dataclass(frozen=True)
class Windows:
    """Which windows to read: `count` windows of `seconds`, the first starting at `since` (Unix time)."""

    since: float
    seconds: float
    count: int

    def end(self, index: int) -> float:
        return self.since + index * self.seconds

    @staticmethod
    def complete(since: float, seconds: float, now: float, lag: float) -> int:
        """Windows that ended at least `lag` seconds ago (the last scrapes of a window are in by then)."""
        return max(0, int(math.floor((now - lag - since) / seconds)))


def pod_matcher(selector: ServiceSelector, pods: Sequence[str], candidate: bool) -> str:
    """The service's matchers plus `pod=~` (candidate) or `pod!~` (control) over the candidate pods' names."""
    if not pods:
        raise ValueError("an experiment needs at least one candidate pod")
    alternatives = "|".join(re.escape(pod).replace("\\", "\\\\") for pod in sorted(pods))
    operator = "=~" if candidate else "!~"
    return selector.matchers()[:-1] + f',{selector.pod_label}{operator}"{alternatives}"}}'


def build_queries(selector: ServiceSelector, candidate_pods: Sequence[str], window_seconds: float,
                  ) -> dict[str, dict[str, str]]:
    """{group: {key: PromQL}} for both groups."""
    w = format_duration(window_seconds)
    out = {}
    for group in GROUPS:
        m = pod_matcher(selector, candidate_pods, group == GROUPS[0])
        pod = selector.pod_label
        tbt, ttft = names.TIME_BETWEEN_TOKENS, names.TIME_TO_FIRST_TOKEN
        reasons = "|".join(ERROR_REASONS)
        out[group] = {
            TBT_P99: f"histogram_quantile(0.99, sum by (le) (increase({tbt}_bucket{m}[{w}])))",
            TTFT_P99: f"histogram_quantile(0.99, sum by (le) (increase({ttft}_bucket{m}[{w}])))",
            GAPS_BY_POD: f"sum by ({pod}) (increase({tbt}_count{m}[{w}]))",
            TBT_BUCKETS_BY_POD: f"sum by ({pod}, le) (increase({tbt}_bucket{m}[{w}]))",
            TOKENS_BY_POD: f"sum by ({pod}) (increase({names.GENERATION_TOKENS}{m}[{w}]))",
            REQUESTS: f"sum(increase({names.PROMPTS}{m}[{w}]))",
            ERRORS: (f'sum(increase({names.REQUESTS_REJECTED}{m[:-1]},reason=~"{reasons}"}}[{w}]))'),
        }
    return out


def goodput_bound(tbt_target_s: float | None) -> float | None:
    """The TBT histogram bound goodput counts under: the largest at or below the target (the smallest bound when
    the target is below all of them); None without a target."""
    if tbt_target_s is None:
        return None
    below = [b for b in names.TBT_BUCKETS if b <= tbt_target_s + 1e-12]
    return max(below) if below else min(names.TBT_BUCKETS)


# --- results -------------------------------------------------------------------------------------------------


def _series(result: Any, key: str) -> list[Mapping[str, Any]]:
    if not isinstance(result, list):
        raise QueryError(f"{key}: expected a list of series, got {type(result).__name__}")
    for series in result:
        if not isinstance(series, Mapping) or not isinstance(series.get("values"), list):
            raise QueryError(f"{key}: expected a range vector")
    return result


def _points(series: Mapping[str, Any], key: str) -> dict[float, float]:
    out = {}
    for point in series["values"]:
        try:
            timestamp, text = point
            value = float(text)
        except (TypeError, ValueError) as exc:
            raise QueryError(f"{key}: malformed sample {point!r}") from exc
        if math.isfinite(value):
            out[round(float(timestamp), 3)] = value
    return out


def _scalar(results: Mapping[str, Any], key: str) -> dict[float, float]:
    series = _series(results[key], key)
    return _points(series[0], key) if series else {}


def _by_pod(results: Mapping[str, Any], key: str, pod_label: str) -> dict[float, dict[str, float]]:
    out: dict[float, dict[str, float]] = {}
    for series in _series(results[key], key):
        pod = (series.get("metric") or {}).get(pod_label, "")
        for timestamp, value in _points(series, key).items():
            out.setdefault(timestamp, {})[pod] = out.get(timestamp, {}).get(pod, 0.0) + value
    return out


def _within_by_pod(results: Mapping[str, Any], bound: float, pod_label: str) -> dict[float, dict[str, float]]:
    """Per window and pod, the increase of the bucket at `bound` (gaps within the target)."""
    out: dict[float, dict[str, float]] = {}
    for series in _series(results[TBT_BUCKETS_BY_POD], TBT_BUCKETS_BY_POD):
        metric = series.get("metric") or {}
        try:
            le = float(metric.get("le", "nan"))
        except ValueError:
            continue
        if not math.isclose(le, bound, rel_tol=1e-9):
            continue
        for timestamp, value in _points(series, TBT_BUCKETS_BY_POD).items():
            out.setdefault(timestamp, {})[metric.get(pod_label, "")] = value
    return out


def _positive(value: float | None) -> float | None:
    return value if value is not None and value > 0 else None


def group_windows(results: Mapping[str, Any], windows: Windows, tbt_target_s: float | None,
                  pod_label: str = "pod") -> list[GroupWindow]:
    """One group's range-query results → one GroupWindow per window (in order)."""
    missing = [key for key in QUERY_KEYS if key not in results]
    if missing:
        raise QueryError(f"results missing for {', '.join(missing)}")
    tbt, ttft = _scalar(results, TBT_P99), _scalar(results, TTFT_P99)
    requests, errors = _scalar(results, REQUESTS), _scalar(results, ERRORS)
    gaps = _by_pod(results, GAPS_BY_POD, pod_label)
    bound = goodput_bound(tbt_target_s)
    good = _within_by_pod(results, bound, pod_label) if bound is not None else _by_pod(results, TOKENS_BY_POD,
                                                                                        pod_label)
    out = []
    for index in range(1, windows.count + 1):
        at = round(windows.end(index), 3)
        pods = {pod: n for pod, n in gaps.get(at, {}).items() if n > 0}
        delivered = good.get(at, {})
        goodput = (sum(delivered.get(pod, 0.0) for pod in pods) / len(pods) / windows.seconds) if pods else None
        out.append(GroupWindow(
            tbt_p99_s=_positive(tbt.get(at)), ttft_p99_s=_positive(ttft.get(at)), goodput_per_pod=goodput,
            tbt_samples=sum(pods.values()), requests=requests.get(at, 0.0), errors=errors.get(at, 0.0),
            pods_seen=len(pods)))
    return out


def window_readings(results: Mapping[str, Mapping[str, Any]], windows: Windows, tbt_target_s: float | None,
                    pod_label: str = "pod") -> list[WindowReading]:
    """Both groups' results ({group: {key: result}}) → WindowReadings."""
    candidate = group_windows(results[GROUPS[0]], windows, tbt_target_s, pod_label)
    control = group_windows(results[GROUPS[1]], windows, tbt_target_s, pod_label)
    return [WindowReading(i + 1, windows.end(i + 1), c, k) for i, (c, k) in enumerate(zip(candidate, control,
                                                                                             strict=True))]
