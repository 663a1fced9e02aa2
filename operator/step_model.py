"""A step-time model for one service: step_seconds ≈ a + b · tokens_per_step, fitted by weighted least squares
from the servers' own (mean tokens, mean seconds) points, and what it predicts for p99 TBT at a chunk size.

Why p99 TBT follows a full-chunk step: every running decode gets one token per step, so a decode's gap
between tokens is the length of the step that produced it. While long prompts are in flight, a step carries
the decodes (D tokens) plus a whole chunk (C tokens), and those heavy steps are what the 99th percentile
sees: p99 TBT ≈ k · (a + b · (D + C)). The factor k (≥ 1) is calibrated from the current observation: the
observed p99 over the model's full-chunk step at the current chunk size, which absorbs noise and per-token
overhead outside the step (sampling, streaming).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from metronome.contract.errors import MetronomeError


class FitError(MetronomeError, ValueError):
    """The points cannot define a line (too few, non-finite, or all at the same token count)."""


@dataclass(frozen=True)
class StepFit:
    intercept_s: float  # a: the cost of a step with no tokens (weights read, launches)
    slope_s_per_token: float  # b
    r_squared: float  # weighted coefficient of determination
    points: int
    token_min: float
    token_max: float
    token_mean: float

    def step_seconds(self, tokens: float) -> float:
        return self.intercept_s + self.slope_s_per_token * tokens

    @property
    def token_spread(self) -> float:
        """(max - min) / mean of the fitted token counts: how far the data reaches along the line."""
        return (self.token_max - self.token_min) / self.token_mean if self.token_mean > 0 else 0.0

    def describe(self) -> str:
        return (f"a={self.intercept_s * 1e3:.2f} ms, b={self.slope_s_per_token * 1e6:.2f} µs/token, "
                f"r²={self.r_squared:.2f}, {self.points} points")


def fit_step_time(tokens: Sequence[float], seconds: Sequence[float],
                  weights: Sequence[float] | None = None) -> StepFit:
    """Weighted least squares of seconds on tokens. Raises FitError when the line is undefined."""
    if weights is None:
        weights = [1.0] * len(tokens)
    if not (len(tokens) == len(seconds) == len(weights)):
        raise FitError(f"tokens, seconds and weights differ in length ({len(tokens)}, {len(seconds)}, {len(weights)})")
    rows = [(float(x), float(y), float(w)) for x, y, w in zip(tokens, seconds, weights)
            if math.isfinite(x) and math.isfinite(y) and math.isfinite(w) and w > 0]
    if len(rows) < 2:
        raise FitError(f"need at least 2 usable points, got {len(rows)}")
    total_w = sum(w for _, _, w in rows)
    mean_x = sum(w * x for x, _, w in rows) / total_w
    mean_y = sum(w * y for _, y, w in rows) / total_w
    sxx = sum(w * (x - mean_x) ** 2 for x, _, w in rows)
    sxy = sum(w * (x - mean_x) * (y - mean_y) for x, y, w in rows)
    syy = sum(w * (y - mean_y) ** 2 for _, y, w in rows)
    if sxx <= 1e-12 * max(1.0, mean_x ** 2) * total_w:
        raise FitError(f"all points have the same tokens per step ({mean_x:.1f}): the slope is undefined")
    slope = sxy / sxx
    intercept = mean_y - slope * mean_x
    residual = sum(w * (y - intercept - slope * x) ** 2 for x, y, w in rows)
    r_squared = 1.0 - residual / syy if syy > 0 else 1.0
    xs = [x for x, _, _ in rows]
    return StepFit(intercept_s=intercept, slope_s_per_token=slope, r_squared=r_squared, points=len(rows),
                   token_min=min(xs), token_max=max(xs), token_mean=sum(xs) / len(xs))


def fit_problem(fit: StepFit, min_points: int, min_r2: float, min_token_spread: float) -> str | None:
    """Why the fit must not be trusted, or None when it is good enough to extrapolate from."""
    if fit.points < min_points:
        return f"only {fit.points} step points (need {min_points})"
    if fit.slope_s_per_token <= 0:
        return f"non-positive slope ({fit.slope_s_per_token * 1e6:.3f} µs/token)"
    if fit.r_squared < min_r2:
        return f"r²={fit.r_squared:.2f} below {min_r2:.2f}"
    if fit.token_spread < min_token_spread:
        return f"tokens per step spread {fit.token_spread:.1%} below {min_token_spread:.0%}"
    return None


def full_chunk_step_seconds(fit: StepFit, decode_batch: float, chunk: float) -> float:
    return fit.step_seconds(decode_batch + chunk)


def calibrate_p99_factor(fit: StepFit, observed_p99_s: float, decode_batch: float, chunk: float,
                         max_factor: float = 4.0) -> float:
    """k = observed p99 / modelled full-chunk step, clamped to [1, max_factor].

    Below 1 means fewer than 1 % of tokens came from full-chunk steps at the current size; smaller chunks
    make such steps more frequent, so k = 1 keeps the prediction on the safe side.
    """
    modelled = full_chunk_step_seconds(fit, decode_batch, chunk)
    if modelled <= 0 or not math.isfinite(observed_p99_s):
        return max_factor
    return min(max_factor, max(1.0, observed_p99_s / modelled))


def predict_tbt_p99(fit: StepFit, decode_batch: float, chunk: float, factor: float) -> float:
    return factor * full_chunk_step_seconds(fit, decode_batch, chunk)


def largest_chunk_within(fit: StepFit, decode_batch: float, factor: float, budget_s: float,
                         granularity: int = 1) -> int | None:
    """The largest multiple of `granularity` whose predicted p99 TBT ≤ budget_s; None when not even one
    granule fits (closed form of factor · (a + b · (D + C)) ≤ budget)."""
    if fit.slope_s_per_token <= 0 or factor <= 0 or granularity < 1:
        raise FitError("largest_chunk_within needs a positive slope, factor and granularity")
    tokens = (budget_s / factor - fit.intercept_s) / fit.slope_s_per_token - decode_batch
    if not math.isfinite(tokens):
        return None
    chunk = int(math.floor(tokens / granularity + 1e-9)) * granularity  # 919.9999 is 920
    return chunk if chunk >= granularity else None
