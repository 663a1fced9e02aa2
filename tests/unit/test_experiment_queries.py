"""An experiment's PromQL (operator/experiment/queries.py): the same queries for both groups with a pod matcher,
and range results → per-window readings (p99s, token gaps per pod, goodput within the TBT target, errors)."""
from __future__ import annotations

import pytest

from metronome.operator.experiment.queries import (
    ERRORS,
    GAPS_BY_POD,
    QUERY_KEYS,
    REQUESTS,
    TBT_BUCKETS_BY_POD,
    TBT_P99,
    TOKENS_BY_POD,
    TTFT_P99,
    QueryError,
    Windows,
    build_queries,
    goodput_bound,
    group_windows,
    pod_matcher,
    window_readings,
)
from metronome.operator.metrics_source import ServiceSelector

SELECTOR = ServiceSelector("ml", "chat")
WINDOWS = Windows(since=1000.0, seconds=30.0, count=2)


def test_the_groups_differ_only_by_the_pod_matcher():
    assert pod_matcher(SELECTOR, ["chat-b", "chat-a.x"], candidate=True) == (
        '{namespace="ml",model="chat",pod=~"chat\\\\-a\\\\.x|chat\\\\-b"}')
    queries = build_queries(SELECTOR, ["chat-a"], 30)
    candidate, control = queries["candidate"], queries["control"]
    assert set(candidate) == set(QUERY_KEYS)
    for key in QUERY_KEYS:
        assert candidate[key].replace('pod=~"', 'pod!~"') == control[key]
    assert candidate[TBT_P99] == ('histogram_quantile(0.99, sum by (le) (increase(metronome_time_between_tokens_'
                                  'seconds_bucket{namespace="ml",model="chat",pod=~"chat\\\\-a"}[30s])))')
    assert 'reason=~"overloaded"}[30s]' in candidate[ERRORS]
    with pytest.raises(ValueError, match="at least one candidate pod"):
        pod_matcher(SELECTOR, [], True)


def test_goodput_counts_under_the_largest_bucket_bound_at_or_below_the_target():
    assert goodput_bound(0.027) == 0.025 and goodput_bound(0.1) == 0.1 and goodput_bound(0.001) == 0.002
    assert goodput_bound(None) is None


def series(values: dict[float, float], **labels) -> dict:
    return {"metric": labels, "values": [[t, str(v)] for t, v in values.items()]}


def results(tbt: float, gaps: dict[str, tuple[float, float]], within: dict[str, tuple[float, float]]) -> dict:
    """Two windows ending at 1030 and 1060; per pod (gaps, gaps within 50 ms) in each."""
    return {
        TBT_P99: [series({1030: tbt, 1060: "NaN"})],
        TTFT_P99: [series({1030: 0.8, 1060: 0.9})],
        GAPS_BY_POD: [series({1030: a, 1060: b}, pod=pod) for pod, (a, b) in gaps.items()],
        TBT_BUCKETS_BY_POD: [*(series({1030: a, 1060: b}, pod=pod, le="0.05") for pod, (a, b) in within.items()),
                             series({1030: 999, 1060: 999}, pod="x", le="+Inf")],
        TOKENS_BY_POD: [series({1030: 300, 1060: 600}, pod=pod) for pod in gaps],
        REQUESTS: [series({1030: 10, 1060: 12})],
        ERRORS: [],
    }


def test_range_results_become_windows():
    data = results(0.04, gaps={"a": (300, 0), "b": (150, 90)}, within={"a": (240, 0), "b": (150, 60)})
    first, second = group_windows(data, WINDOWS, tbt_target_s=0.05)
    assert (first.tbt_p99_s, first.ttft_p99_s, first.tbt_samples, first.pods_seen) == (0.04, 0.8, 450, 2)
    assert first.goodput_per_pod == pytest.approx((240 + 150) / 2 / 30)
    assert (first.requests, first.errors) == (10, 0)
    # A NaN quantile is no measurement; a pod without gaps in the window is not "seen" and not averaged in.
    assert (second.tbt_p99_s, second.pods_seen, second.goodput_per_pod) == (None, 1, pytest.approx(60 / 30))
    no_slo = group_windows(data, WINDOWS, tbt_target_s=None)[0]
    assert no_slo.goodput_per_pod == pytest.approx(300 / 30)  # output tokens per pod-second


def test_both_groups_make_readings_and_bad_results_are_refused():
    data = results(0.04, gaps={"a": (300, 300)}, within={"a": (300, 300)})
    readings = window_readings({"candidate": data, "control": data}, WINDOWS, 0.05)
    assert [(r.index, r.end) for r in readings] == [(1, 1030.0), (2, 1060.0)]
    with pytest.raises(QueryError, match="missing"):
        group_windows({TBT_P99: []}, WINDOWS, None)
    with pytest.raises(QueryError, match="range vector"):
        group_windows({**data, TBT_P99: [{"metric": {}, "value": [1, "2"]}]}, WINDOWS, None)


def test_complete_windows_wait_for_the_last_scrapes():
    assert Windows.complete(since=1000, seconds=30, now=1059, lag=2) == 1
    assert Windows.complete(since=1000, seconds=30, now=1062, lag=2) == 2
    assert Windows.complete(since=1000, seconds=30, now=990, lag=2) == 0
