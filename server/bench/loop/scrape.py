"""The operator's queries answered from the servers' own /metrics, without Prometheus.

`metronome bench loop` scrapes every server each second into `Scrape`s. `query_results` evaluates, over a window
of those scrapes, each query of `metronome.operator.metrics_source.build_queries` — same series, same aggregation,
`histogram_quantile` from metronome.contract.histogram — and returns Prometheus' JSON `result` lists, so that
`observation_from_results` (the operator's own parser) turns them into the Observation the controller reads.
Counters are read as increases between the scrape nearest the window's start and the last one (PromQL's rate()
also extrapolates to the window's edges; over a window of many scrapes the difference is small). Pure.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from metronome.contract import metric_names as names
from metronome.contract.histogram import bucket_increase, histogram_quantile
from metronome.operator import metrics_source as ms

Labels = frozenset  # of (name, value) pairs


@dataclass(frozen=True)
class Scrape:
    """One reading of one server's /metrics at `time` (seconds, the loop's clock)."""

    pod: str
    time: float
    samples: Mapping[tuple[str, Labels], float]

    def total(self, name: str, **labels: str) -> float | None:
        """Sum of the samples named `name` whose labels include `labels`; None when there is none."""
        wanted = set(labels.items())
        found = [v for (n, ls), v in self.samples.items() if n == name and wanted <= ls]
        return sum(found) if found else None

    def buckets(self, histogram: str, **labels: str) -> dict[float, float]:
        """Cumulative bucket counts by upper bound, summed over the other labels."""
        wanted = set(labels.items())
        out: dict[float, float] = {}
        for (n, ls), value in self.samples.items():
            if n == histogram + "_bucket" and wanted <= ls:
                le = float(dict(ls)["le"])
                out[le] = out.get(le, 0.0) + value
        return out


def parse_scrape(text: str, pod: str, time: float) -> Scrape:
    from prometheus_client.parser import text_string_to_metric_families

    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = float(sample.value)
    return Scrape(pod, time, samples)


# --- one pod's window --------------------------------------------------------------------------------------------

def _window(scrapes: Sequence[Scrape], start: float, end: float) -> tuple[Scrape, Scrape] | None:
    """(the scrape nearest `start`, the last one at or before `end`) of one pod, or None without two."""
    inside = [s for s in scrapes if s.time <= end + 1e-9]
    if len(inside) < 2:
        return None
    last = inside[-1]
    first = min(inside[:-1], key=lambda s: abs(s.time - start))
    return first, last


def _increase(pair: tuple[Scrape, Scrape], name: str, **labels: str) -> float | None:
    first, last = pair
    later = last.total(name, **labels)
    if later is None:
        return None
    earlier = first.total(name, **labels) or 0.0
    return later - earlier if later >= earlier else later


def _rate(pair: tuple[Scrape, Scrape], name: str, **labels: str) -> float | None:
    increase = _increase(pair, name, **labels)
    span = pair[1].time - pair[0].time
    return increase / span if increase is not None and span > 0 else None


# --- the queries -------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Pods:
    """Every pod's scrapes, oldest first, and the window to evaluate at `end`."""

    scrapes: Mapping[str, Sequence[Scrape]]
    window_s: float
    sub_window_s: float
    end: float

    def pairs(self, start: float | None = None, end: float | None = None) -> dict[str, tuple[Scrape, Scrape]]:
        end = self.end if end is None else end
        start = end - self.window_s if start is None else start
        out = {}
        for pod, scrapes in self.scrapes.items():
            pair = _window(scrapes, start, end)
            if pair is not None:
                out[pod] = pair
        return out


def _instant(value: float | None, end: float, metric: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
    if value is None:
        return []
    return [{"metric": dict(metric or {}), "value": [end, _text(value)]}]


def _text(value: float) -> str:
    return "NaN" if math.isnan(value) else repr(float(value))


def _sum(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) if present else None


def _quantile(pods: Pods, histogram: str, q: float = 0.99, **labels: str) -> list[dict[str, Any]]:
    pairs = pods.pairs()
    if not pairs:
        return []
    merged: list[tuple[float, float]] = []
    for first, last in pairs.values():
        merged += bucket_increase(last.buckets(histogram, **labels), first.buckets(histogram, **labels))
    if not merged:
        return []
    return _instant(histogram_quantile(q, merged), pods.end)


def _quantile_by_lane(pods: Pods, histogram: str) -> list[dict[str, Any]]:
    """histogram_quantile(0.99, sum by (le, lane) (...)): one series per lane."""
    out = []
    for lane in names.LANES:
        for series in _quantile(pods, histogram, **{names.LANE_LABEL: lane}):
            out.append({**series, "metric": {names.LANE_LABEL: lane}})
    return out


def _total_increase(pods: Pods, name: str, **labels: str) -> list[dict[str, Any]]:
    return _instant(_sum([_increase(pair, name, **labels) for pair in pods.pairs().values()]), pods.end)


def _total_rate(pods: Pods, name: str, **labels: str) -> list[dict[str, Any]]:
    return _instant(_sum([_rate(pair, name, **labels) for pair in pods.pairs().values()]), pods.end)


def _gauge_average(pods: Pods, name: str, per_pod_sum: bool = False) -> list[dict[str, Any]]:
    """avg(avg_over_time(gauge[window])): each pod's mean over its scrapes in the window, then the mean across
    pods (or their sum: sum(avg_over_time(...)))."""
    means = []
    for scrapes in pods.scrapes.values():
        values = [v for s in scrapes if pods.end - pods.window_s <= s.time <= pods.end + 1e-9
                  for v in [s.total(name)] if v is not None]
        if values:
            means.append(sum(values) / len(values))
    if not means:
        return []
    return _instant(sum(means) if per_pod_sum else sum(means) / len(means), pods.end)


def _sub_window_rates(pods: Pods, name: str) -> list[dict[str, Any]]:
    """(sum by (pod, kind) (rate(x[s])))[w:s]: per pod and step kind, the rate over each sub-window ending at
    end, end - s, ..."""
    out = []
    steps = max(1, int(round(pods.window_s / pods.sub_window_s)))
    for pod, scrapes in pods.scrapes.items():
        for kind in names.STEP_KINDS:
            values = []
            for k in reversed(range(steps)):
                point = pods.end - k * pods.sub_window_s
                pair = _window(scrapes, point - pods.sub_window_s, point)
                full = pair is not None and pair[0].time >= point - pods.sub_window_s - 1.0
                rate = _rate(pair, name, **{names.STEP_KIND_LABEL: kind}) if full else None
                if rate is not None:
                    values.append([point, _text(rate)])
            if values:
                out.append({"metric": {"pod": pod, names.STEP_KIND_LABEL: kind}, "values": values})
    return out


def _latest_by_pod(pods: Pods, name: str) -> list[dict[str, Any]]:
    """max by (pod) (gauge): each pod's value at its last scrape."""
    out = []
    for pod, scrapes in pods.scrapes.items():
        latest = [s for s in scrapes if s.time <= pods.end + 1e-9]
        value = latest[-1].total(name) if latest else None
        if value is not None:
            out.append({"metric": {"pod": pod}, "value": [pods.end, _text(value)]})
    return out


def _gauge_delta(pods: Pods, name: str) -> list[dict[str, Any]]:
    """sum(delta(gauge[window])): each pod's last value minus its value at the window's start, added up."""
    changes = []
    for first, last in pods.pairs().values():
        before, after = first.total(name), last.total(name)
        changes.append(after - before if before is not None and after is not None else None)
    return _instant(_sum(changes), pods.end)


def _increase_by_lane(pods: Pods, name: str) -> list[dict[str, Any]]:
    """sum by (lane) (increase(counter[window]))."""
    out = []
    for lane in names.LANES:
        value = _sum([_increase(pair, name, **{names.LANE_LABEL: lane}) for pair in pods.pairs().values()])
        if value is not None:
            out.append({"metric": {names.LANE_LABEL: lane}, "value": [pods.end, _text(value)]})
    return out


EVALUATORS: dict[str, Callable[[Pods], list[dict[str, Any]]]] = {
    ms.TBT_P99: lambda p: _quantile(p, names.TIME_BETWEEN_TOKENS),
    ms.TBT_COUNT: lambda p: _total_increase(p, names.TIME_BETWEEN_TOKENS + "_count"),
    ms.TTFT_P99: lambda p: _quantile(p, names.TIME_TO_FIRST_TOKEN),
    ms.OUTPUT_TOKENS_RATE: lambda p: _total_rate(p, names.GENERATION_TOKENS),
    ms.PROMPT_TOKENS_RATE: lambda p: _total_rate(p, names.PROMPT_TOKENS),
    ms.REQUESTS_RATE: lambda p: _total_rate(p, names.REQUEST_E2E + "_count"),
    ms.RUNNING_PER_POD: lambda p: _gauge_average(p, names.REQUESTS_RUNNING),
    ms.STEP_TOKENS_RATE: lambda p: _sub_window_rates(p, names.STEP_TOKENS + "_sum"),
    ms.STEP_SECONDS_RATE: lambda p: _sub_window_rates(p, names.STEP_DURATION + "_sum"),
    ms.STEP_COUNT_RATE: lambda p: _sub_window_rates(p, names.STEP_DURATION + "_count"),
    ms.GENERATION_BY_POD: lambda p: _latest_by_pod(p, names.CONFIG_GENERATION),
    ms.TBT_P99_BY_LANE: lambda p: _quantile_by_lane(p, names.TIME_BETWEEN_TOKENS),
    ms.PROMPTS_BY_LANE: lambda p: _increase_by_lane(p, names.PROMPTS),
    ms.APPLIED_BY_POD: lambda p: _latest_by_pod(p, names.CONFIG_APPLIED_TIME),
    ms.WAITING: lambda p: _gauge_average(p, names.REQUESTS_WAITING, per_pod_sum=True),
    ms.WAITING_GROWTH: lambda p: _gauge_delta(p, names.REQUESTS_WAITING),
    ms.PREFILLING: lambda p: _gauge_average(p, names.REQUESTS_PREFILLING, per_pod_sum=True),
}


def query_results(scrapes: Mapping[str, Sequence[Scrape]], window: ms.QueryWindow, end: float) -> dict[str, list]:
    """Prometheus-shaped results of every operator query over [end - window, end]."""
    missing = [key for key in ms.QUERY_KEYS if key not in EVALUATORS]
    if missing:
        raise RuntimeError(f"bench loop cannot evaluate the operator's queries {missing}: add them to EVALUATORS")
    pods = Pods(scrapes, window.window_seconds, window.sub_window_seconds, end)
    return {key: EVALUATORS[key](pods) for key in ms.QUERY_KEYS}


def observe(scrapes: Mapping[str, Sequence[Scrape]], window: ms.QueryWindow, end: float):
    """The Observation the operator would build from Prometheus at `end` (raises MetricsUnavailable likewise)."""
    return ms.observation_from_results(query_results(scrapes, window, end), window)
