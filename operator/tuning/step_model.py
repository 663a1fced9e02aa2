"""A step-time model for one service: step_seconds ≈ a + b · tokens_per_step (+ m for a mixed step), fitted by
weighted least squares from the servers' own (mean tokens, mean seconds) points, and what it predicts for p99 TBT
and for prefill throughput at a chunk size.

Why decode and mixed steps apart (the step metrics' `kind` label): on a GPU a step that carries prefill tokens
costs more than its tokens alone say (more kernels, attention over fresh chunks, launches): 64 decodes take
11.5 ms, with 128 prompt tokens more 14.5 ms, so one line through both kinds sees a cheap per-step cost and
too steep a slope. Given both kinds, the fit has a third term m, the fixed extra of a mixed step. That fixed cost
is also why a small chunk starves prefill: prefill tokens per second = C / (a + m + b · (D + C)) falls with C.
A negative m is unphysical (carrying prefill never makes a step cheaper; it comes from the mixed indicator being
nearly collinear with tokens per step, as mixed steps are the heavy ones): the least-squares fit under m ≥ 0 is
then the one at m = 0, i.e. one line through all points, and that is the fit returned.

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
from dataclasses import dataclass, replace

from metronome.contract.errors import MetronomeError


class FitError(MetronomeError, ValueError):
    """The points cannot define a line (too few, non-finite, or all at the same token count)."""


MIXED_EXTRA_DROPPED = "all, mixed extra < 0 dropped"  # the kinds of a fit whose unconstrained m came out negative


@dataclass(frozen=True)
class StepFit:
    intercept_s: float  # a: the cost of a step with no tokens (weights read, launches)
    slope_s_per_token: float  # b
    r_squared: float  # weighted coefficient of determination
    points: int
    token_min: float
    token_max: float
    token_mean: float
    mixed_extra_s: float = 0.0  # m: the fixed extra of a step that carries prefill (0 without both kinds)
    # "decode+mixed" when m was fitted, else the one kind fitted ("mixed", "decode", "all"), or MIXED_EXTRA_DROPPED
    kinds: str = "all"

    def step_seconds(self, tokens: float, mixed: bool = True) -> float:
        return self.intercept_s + (self.mixed_extra_s if mixed else 0.0) + self.slope_s_per_token * tokens

    @property
    def token_spread(self) -> float:
        """(max - min) / mean of the fitted token counts: how far the data reaches along the line."""
        return (self.token_max - self.token_min) / self.token_mean if self.token_mean > 0 else 0.0

    def describe(self) -> str:
        extra = f", mixed +{self.mixed_extra_s * 1e3:.2f} ms" if self.kinds == "decode+mixed" else ""
        return (f"a={self.intercept_s * 1e3:.2f} ms, b={self.slope_s_per_token * 1e6:.2f} µs/token{extra}, "
                f"r²={self.r_squared:.2f}, {self.points} points ({self.kinds})")


def fit_step_time(tokens: Sequence[float], seconds: Sequence[float],
                  weights: Sequence[float] | None = None, mixed: Sequence[bool] | None = None,
                  min_kind_spread: float = 0.05) -> StepFit:
    """Weighted least squares of seconds on tokens. With `mixed` (which points are mixed steps) and points of both
    kinds, seconds on tokens and a mixed-step indicator (see the module docstring) — provided there are 5 points
    or more and the tokens per step of one kind spread by `min_kind_spread` of their mean at least: otherwise the
    three terms would rest on too little, and one line through all points is the steadier reading. When the
    three-term fit gives m < 0, the least squares under m ≥ 0 is the fit at m = 0: one line through all points,
    with kinds MIXED_EXTRA_DROPPED. Raises FitError when the line is undefined."""
    if weights is None:
        weights = [1.0] * len(tokens)
    told = mixed is not None
    if mixed is None:
        mixed = [True] * len(tokens)
    if not (len(tokens) == len(seconds) == len(weights) == len(mixed)):
        raise FitError(f"tokens, seconds, weights and kinds differ in length ({len(tokens)}, {len(seconds)}, "
                       f"{len(weights)}, {len(mixed)})")
    both = [(float(x), float(y), float(w), bool(k)) for x, y, w, k in zip(tokens, seconds, weights, mixed)
            if math.isfinite(x) and math.isfinite(y) and math.isfinite(w) and w > 0]
    if len({k for *_, k in both}) == 2 and len(both) >= 5 and max(
            _spread([x for x, *_, k in both if k]), _spread([x for x, *_, k in both if not k])) >= min_kind_spread:
        three = _fit_with_mixed_extra(both)
        if three.mixed_extra_s >= 0:
            return three
        return replace(_fit_line(both, told), kinds=MIXED_EXTRA_DROPPED)
    return _fit_line(both, told)


def _fit_line(both: list[tuple[float, float, float, bool]], told: bool) -> StepFit:
    """seconds ≈ a + b · tokens by weighted least squares, through every point whatever its kind."""
    rows = [(x, y, w) for x, y, w, _ in both]
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
    present = {k for *_, k in both}
    kinds = ("mixed" if present == {True} else "decode") if told and len(present) == 1 else "all"
    return StepFit(intercept_s=intercept, slope_s_per_token=slope, r_squared=r_squared, points=len(rows),
                   token_min=min(xs), token_max=max(xs), token_mean=sum(xs) / len(xs), kinds=kinds)


def _spread(xs: list[float]) -> float:
    mean = sum(xs) / len(xs) if xs else 0.0
    return (max(xs) - min(xs)) / mean if mean > 0 else 0.0


def _fit_with_mixed_extra(rows: list[tuple[float, float, float, bool]]) -> StepFit:
    """seconds ≈ a + m · [mixed] + b · tokens by weighted least squares (normal equations, 3 × 3)."""
    if len(rows) < 3:
        raise FitError(f"need at least 3 usable points to fit decode and mixed steps, got {len(rows)}")
    features = [(1.0, 1.0 if k else 0.0, x) for x, _, _, k in rows]
    normal = [[sum(w * f[i] * f[j] for f, (_, _, w, _) in zip(features, rows)) for j in range(3)] for i in range(3)]
    rhs = [sum(w * f[i] * y for f, (_, y, w, _) in zip(features, rows)) for i in range(3)]
    try:
        a, m, b = _solve3(normal, rhs)
    except ZeroDivisionError:
        raise FitError("the points cannot separate a mixed-step cost from a per-token cost (no spread in tokens "
                       "within a kind)") from None
    total_w = sum(w for *_, w, _ in rows)
    mean_y = sum(w * y for _, y, w, _ in rows) / total_w
    syy = sum(w * (y - mean_y) ** 2 for _, y, w, _ in rows)
    residual = sum(w * (y - a - m * f[1] - b * x) ** 2 for f, (x, y, w, _) in zip(features, rows))
    xs = [x for x, *_ in rows]
    return StepFit(intercept_s=a, slope_s_per_token=b, r_squared=1.0 - residual / syy if syy > 0 else 1.0,
                   points=len(rows), token_min=min(xs), token_max=max(xs), token_mean=sum(xs) / len(xs),
                   mixed_extra_s=m, kinds="decode+mixed")


def _solve3(matrix: list[list[float]], rhs: list[float]) -> tuple[float, float, float]:
    """Gaussian elimination with partial pivoting; ZeroDivisionError when (nearly) singular."""
    rows = [list(row) + [value] for row, value in zip(matrix, rhs)]
    scale = max(abs(v) for row in matrix for v in row) or 1.0
    for col in range(3):
        pivot = max(range(col, 3), key=lambda r: abs(rows[r][col]))
        if abs(rows[pivot][col]) <= 1e-12 * scale:
            raise ZeroDivisionError
        rows[col], rows[pivot] = rows[pivot], rows[col]
        for r in range(col + 1, 3):
            factor = rows[r][col] / rows[col][col]
            rows[r] = [v - factor * p for v, p in zip(rows[r], rows[col])]
    out = [0.0, 0.0, 0.0]
    for r in (2, 1, 0):
        out[r] = (rows[r][3] - sum(rows[r][c] * out[c] for c in range(r + 1, 3))) / rows[r][r]
    return out[0], out[1], out[2]


def fit_problem(fit: StepFit, min_points: int, min_r2: float, min_token_spread: float) -> str | None:
    """Why the fit must not be trusted, or None when it is good enough to extrapolate from."""
    if fit.points < min_points:
        return f"only {fit.points} step points (need {min_points})"
    if fit.slope_s_per_token <= 0:
        return f"non-positive slope ({fit.slope_s_per_token * 1e6:.3f} µs/token)"
    if fit.step_seconds(fit.token_min, mixed=True) <= 0:
        return f"a mixed step of {fit.token_min:.0f} tokens would take no time ({fit.describe()})"
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


def smallest_chunk_for_prefill(fit: StepFit, decode_batch: float, demand_tokens_per_s: float, granularity: int,
                               ceiling: int) -> int | None:
    """The smallest multiple of `granularity` whose prefill throughput C / step(D + C) covers the demand (closed
    form: C ≥ λ · (a + m + b · D) / (1 - b · λ)); None when even `ceiling` would not (then prefill cannot keep
    up at any chunk: more replicas are the answer)."""
    if demand_tokens_per_s <= 0:
        return granularity
    per_step = fit.step_seconds(decode_batch, mixed=True)
    room = 1.0 - fit.slope_s_per_token * demand_tokens_per_s
    if room <= 0 or per_step <= 0:
        return None
    chunk = int(math.ceil(demand_tokens_per_s * per_step / room / granularity - 1e-9)) * granularity
    chunk = max(chunk, granularity)
    return chunk if chunk <= ceiling else None


def largest_chunk_within(fit: StepFit, decode_batch: float, factor: float, budget_s: float,
                         granularity: int = 1) -> int | None:
    """The largest multiple of `granularity` whose predicted p99 TBT ≤ budget_s; None when not even one
    granule fits (closed form of factor · (a + m + b · (D + C)) ≤ budget: a full-chunk step is a mixed one)."""
    if fit.slope_s_per_token <= 0 or factor <= 0 or granularity < 1:
        raise FitError("largest_chunk_within needs a positive slope, factor and granularity")
    tokens = (budget_s / factor - fit.step_seconds(0.0, mixed=True)) / fit.slope_s_per_token - decode_batch
    if not math.isfinite(tokens):
        return None
    chunk = int(math.floor(tokens / granularity + 1e-9)) * granularity  # 919.9999 is 920
    return chunk if chunk >= granularity else None
