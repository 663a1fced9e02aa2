"""metronome.contract.histogram: PromQL's histogram_quantile on plain bucket counts (what `metronome bench loop`
computes from /metrics and the operator reads from Prometheus must be the same number)."""
from __future__ import annotations

import math

import pytest

from metronome.contract.histogram import bucket_increase, histogram_quantile, merge_buckets

INF = math.inf


def test_linear_interpolation_inside_the_bucket_that_holds_the_rank():
    buckets = [(0.1, 10), (0.2, 20), (INF, 20)]
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.1)  # rank 10 = all of the first bucket
    assert histogram_quantile(0.75, buckets) == pytest.approx(0.15)  # rank 15: halfway through (0.1, 0.2]
    assert histogram_quantile(0.25, buckets) == pytest.approx(0.05)  # the first bucket starts at 0
    assert histogram_quantile(1.0, buckets) == pytest.approx(0.2)


def test_a_rank_in_the_inf_bucket_gives_the_largest_finite_bound():
    assert histogram_quantile(0.99, [(0.1, 10), (0.2, 20), (INF, 30)]) == 0.2


def test_order_and_duplicate_bounds_are_merged_like_sum_by_le():
    pods = [(INF, 4), (0.02, 1), (0.01, 0), (0.01, 2), (0.02, 3), (INF, 4)]  # two pods' buckets, shuffled
    assert merge_buckets(pods) == [(0.01, 2), (0.02, 4), (INF, 8)]
    # rank 0.99 * 8 = 7.92 is in +Inf: the largest finite bound
    assert histogram_quantile(0.99, pods) == 0.02
    assert histogram_quantile(0.5, pods) == pytest.approx(0.01 + 0.01 * (4 - 2) / (4 - 2))


def test_non_monotonic_counts_are_fixed_and_degenerate_inputs_are_nan():
    # A scrape can catch buckets mid-update; Prometheus takes the running maximum.
    assert histogram_quantile(0.5, [(0.1, 10), (0.2, 8), (INF, 20)]) == pytest.approx(0.1)  # 8 read as 10
    assert histogram_quantile(0.6, [(0.1, 10), (0.2, 8), (INF, 20)]) == 0.2
    assert math.isnan(histogram_quantile(0.99, [(0.1, 0), (INF, 0)]))  # no observations
    assert math.isnan(histogram_quantile(0.99, [(0.1, 5)]))  # no +Inf bucket
    assert math.isnan(histogram_quantile(0.99, [(INF, 5)]))  # fewer than two buckets
    assert histogram_quantile(-0.1, [(0.1, 1), (INF, 1)]) == -INF
    assert histogram_quantile(1.5, [(0.1, 1), (INF, 1)]) == INF
    assert math.isnan(histogram_quantile(math.nan, [(0.1, 1), (INF, 1)]))


def test_bucket_increase_over_a_window_and_across_a_counter_reset():
    earlier = {0.1: 5.0, 0.2: 7.0, INF: 9.0}
    later = {0.1: 6.0, 0.2: 10.0, INF: 12.0}
    assert bucket_increase(later, earlier) == [(0.1, 1.0), (0.2, 3.0), (INF, 3.0)]
    assert bucket_increase(later, None) == [(0.1, 6.0), (0.2, 10.0), (INF, 12.0)]
    restarted = {0.1: 1.0, 0.2: 1.0, INF: 2.0}
    assert bucket_increase(restarted, earlier) == [(0.1, 1.0), (0.2, 1.0), (INF, 2.0)]
