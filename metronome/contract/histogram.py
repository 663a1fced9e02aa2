"""PromQL's `histogram_quantile` on plain numbers, so that a reader of /metrics (`metronome bench loop`) and a reader
of Prometheus (the operator) interpolate the same p99 from the same buckets. Pure; no Prometheus client.

A histogram here is its cumulative buckets as (upper bound `le`, count) pairs, the +Inf bucket included, e.g. the
increase of each `_bucket{le=...}` series over a window, summed across pods by `le`.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

Buckets = list[tuple[float, float]]


def histogram_quantile(q: float, buckets: Iterable[tuple[float, float]]) -> float:
    """The q-quantile as Prometheus computes it (promql/quantile.go, bucketQuantile):

    counts are made monotonic, rank = q · total; the first bucket whose count reaches the rank is interpolated
    linearly from the bound below it (0 for the first bucket); a rank in the +Inf bucket gives the largest finite
    bound. NaN without a +Inf bucket, with fewer than two buckets, or with no observations; -Inf/+Inf for q
    below 0 / above 1.
    """
    if math.isnan(q):
        return math.nan
    if q < 0:
        return -math.inf
    if q > 1:
        return math.inf
    rows = merge_buckets(buckets)
    if len(rows) < 2 or rows[-1][0] != math.inf:
        return math.nan
    monotonic, highest = [], 0.0
    for le, count in rows:
        highest = max(highest, count)
        monotonic.append((le, highest))
    total = monotonic[-1][1]
    if total <= 0:
        return math.nan
    rank = q * total
    index = next((i for i, (_, count) in enumerate(monotonic[:-1]) if count >= rank), len(monotonic) - 1)
    if index == len(monotonic) - 1:
        return monotonic[-2][0]
    end, count = monotonic[index]
    if index == 0:
        if end <= 0:
            return end
        start, below = 0.0, 0.0
    else:
        start, below = monotonic[index - 1]
    if count == below:
        return end
    return start + (end - start) * (rank - below) / (count - below)


def merge_buckets(buckets: Iterable[tuple[float, float]]) -> Buckets:
    """Sorted by bound, counts of equal bounds added (what `sum by (le)` does across series)."""
    merged: dict[float, float] = {}
    for le, count in buckets:
        merged[float(le)] = merged.get(float(le), 0.0) + float(count)
    return sorted(merged.items())


def bucket_increase(later: Mapping[float, float], earlier: Mapping[float, float] | None) -> Buckets:
    """The increase of one histogram's buckets between two readings; a bucket that went down means the counters
    were reset (the process restarted), and its increase is then its new value, as in PromQL's increase()."""
    out = []
    for le, count in later.items():
        before = (earlier or {}).get(le, 0.0)
        out.append((le, count - before if count >= before else count))
    return sorted(out)
