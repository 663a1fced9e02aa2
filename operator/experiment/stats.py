"""The statistics of an experiment, pure and exact (no normal approximations: an experiment has a handful of
windows, not thousands).

Per-window ratios (candidate / control over the same window) and the sign test. Under "the candidate is no
different", each window's ratio is as likely above its true median as below it, so the number of windows below the
median is Binomial(n, 1/2), whatever the shape of the noise. Inverted, that gives distribution-free bounds on the
median ratio from the order statistics: with the ratios sorted r(1) <= ... <= r(n), r(k) is a lower bound at
confidence P(Binomial(n, 1/2) >= k) and r(n + 1 - k) the matching upper bound. Comparing a bound with a threshold
is the sign test of the ratios against that threshold: "the median TBT ratio is above 1.10 with 95 % confidence"
holds exactly when the sign test says so. Outlying windows (a busy spell on one node) move a bound by one rank at
most, never by their size.

Error counts are too sparse for ratios (most windows have none): `error_rate_p_value` pools them and asks, with
an exact binomial test conditional on the total, whether the candidate has more errors than its share of the
requests explains.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


def binomial_tail(n: int, k: int, p: float = 0.5) -> float:
    """P(X >= k) for X ~ Binomial(n, p)."""
    if k <= 0:
        return 1.0
    if k > n:
        return 0.0
    return math.fsum(math.comb(n, i) * p ** i * (1 - p) ** (n - i) for i in range(k, n + 1))


def order_rank(n: int, confidence: float) -> int | None:
    """The largest k with P(Binomial(n, 1/2) >= k) >= confidence: r(k) is then a lower bound of the median at
    that confidence (and r(n + 1 - k) an upper one). None when even the extremes (k = 1) are not that sure."""
    best = None
    for k in range(1, n + 1):
        if binomial_tail(n, k) >= confidence:
            best = k
        else:
            break
    return best


@dataclass(frozen=True)
class MedianBounds:
    """The median of the per-window values and its one-sided bounds at `confidence` (None: too few windows)."""

    n: int
    median: float | None
    lower: float | None
    upper: float | None
    confidence: float

    @property
    def known(self) -> bool:
        return self.lower is not None and self.upper is not None


def median_bounds(values: Sequence[float], confidence: float) -> MedianBounds:
    ordered = sorted(values)
    n = len(ordered)
    if n == 0:
        return MedianBounds(0, None, None, None, confidence)
    middle = n // 2
    median = ordered[middle] if n % 2 else (ordered[middle - 1] + ordered[middle]) / 2
    k = order_rank(n, confidence)
    if k is None:
        return MedianBounds(n, median, None, None, confidence)
    return MedianBounds(n, median, ordered[k - 1], ordered[n - k], confidence)


def error_rate_p_value(candidate_errors: int, candidate_requests: int, control_errors: int,
                       control_requests: int) -> float | None:
    """One-sided p-value of "the candidate's error rate is no higher than the control's", from pooled counts
    (errors are rare events of a Poisson process with rate ∝ requests). Given E errors in all, under equal rates
    the candidate's count is Binomial(E, its share of the requests); the p-value is the chance of at least as
    many as it had. None when there is nothing to test (no requests on a side, or no errors at all)."""
    if candidate_requests <= 0 or control_requests <= 0:
        return None
    total = candidate_errors + control_errors
    if total == 0:
        return None
    share = candidate_requests / (candidate_requests + control_requests)
    return binomial_tail(total, candidate_errors, share)
