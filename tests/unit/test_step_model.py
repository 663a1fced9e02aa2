"""The step-time model: least squares with weights, goodness of fit, and p99 TBT prediction."""
from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metronome.operator.tuning.step_model import (
    MIXED_EXTRA_DROPPED,
    FitError,
    calibrate_p99_factor,
    fit_problem,
    fit_step_time,
    largest_chunk_within,
    predict_tbt_p99,
)


def test_exact_line_is_recovered():
    tokens = [64, 128, 512, 1024, 2048]
    fit = fit_step_time(tokens, [0.005 + 12e-6 * t for t in tokens])
    assert fit.intercept_s == pytest.approx(0.005) and fit.slope_s_per_token == pytest.approx(12e-6)
    assert fit.r_squared == pytest.approx(1.0) and fit.points == 5
    assert (fit.token_min, fit.token_max) == (64, 2048)
    assert fit.step_seconds(1000) == pytest.approx(0.017)
    assert "r²=1.00" in fit.describe() and "12.00 µs/token" in fit.describe()


def test_noisy_line_is_close_and_r2_drops_with_noise():
    rng = random.Random(0)
    tokens = [rng.uniform(50, 1500) for _ in range(40)]
    clean = fit_step_time(tokens, [0.008 + 20e-6 * t * rng.gauss(1, 0.02) for t in tokens])
    noisy = fit_step_time(tokens, [0.008 + 20e-6 * t + rng.gauss(0, 0.01) for t in tokens])
    assert clean.slope_s_per_token == pytest.approx(20e-6, rel=0.05)
    assert clean.r_squared > 0.95 > noisy.r_squared


def test_weights_favour_well_sampled_points():
    tokens, seconds = [100, 200, 300, 400], [0.010, 0.012, 0.014, 0.050]  # the last point is an outlier
    unweighted = fit_step_time(tokens, seconds)
    weighted = fit_step_time(tokens, seconds, [1000, 1000, 1000, 1])
    assert weighted.slope_s_per_token == pytest.approx(20e-6, rel=0.05)
    assert unweighted.slope_s_per_token > 2 * weighted.slope_s_per_token


@pytest.mark.parametrize("tokens,seconds,weights,text", [
    ([100], [0.01], None, "at least 2"),
    ([100, 100, 100], [0.01, 0.02, 0.03], None, "same tokens per step"),
    ([100, float("nan"), 200], [0.01, 0.02, float("inf")], None, "at least 2"),
    ([100, 200], [0.01, 0.02], [0, 0], "at least 2"),
    ([100, 200], [0.01], None, "differ in length"),
])
def test_undefined_lines_raise(tokens, seconds, weights, text):
    with pytest.raises(FitError, match=text):
        fit_step_time(tokens, seconds, weights)


def test_a_negative_mixed_extra_gives_the_pooled_line():
    # As on the H200 (a=8.88 ms, b=39.87 µs/token, m=-32.17 ms): the three-term fit puts mixed steps below the
    # decode line. Least squares under m >= 0 is then the fit at m = 0, one weighted line through all points.
    tokens = [40, 60, 80, 600, 1500, 4000]
    seconds = [0.010 + 40e-6 * t - (0.005 if t > 100 else 0.0) for t in tokens]
    weights, mixed = [50, 80, 20, 30, 10, 5], [False] * 3 + [True] * 3
    fit = fit_step_time(tokens, seconds, weights, mixed)
    pooled = fit_step_time(tokens, seconds, weights)
    assert fit.kinds == MIXED_EXTRA_DROPPED and fit.mixed_extra_s == 0.0 and "dropped" in fit.describe()
    assert (fit.intercept_s, fit.slope_s_per_token, fit.r_squared, fit.points, fit.token_min, fit.token_max) == (
        pooled.intercept_s, pooled.slope_s_per_token, pooled.r_squared, pooled.points, pooled.token_min,
        pooled.token_max)
    assert fit_problem(fit, 6, 0.8, 0.05) is None  # usable, where the negative extra predicted a free step
    # A positive extra in the same layout is still fitted as the third term.
    up = fit_step_time(tokens, [0.010 + 40e-6 * t + (0.005 if t > 100 else 0.0) for t in tokens], weights, mixed)
    assert up.kinds == "decode+mixed" and up.mixed_extra_s == pytest.approx(0.005)


def test_fit_problems():
    good = fit_step_time([100, 300, 500, 700], [0.01, 0.014, 0.018, 0.022])
    assert fit_problem(good, 4, 0.8, 0.05) is None
    assert "only 4 step points" in fit_problem(good, 5, 0.8, 0.05)
    falling = fit_step_time([100, 300, 500, 700], [0.022, 0.018, 0.014, 0.01])
    assert "non-positive slope" in fit_problem(falling, 4, 0.8, 0.05)
    narrow = fit_step_time([500, 501, 502, 503], [0.018, 0.018, 0.018, 0.01803])
    assert "spread" in fit_problem(narrow, 4, 0.5, 0.05)
    scattered = fit_step_time([100, 200, 300, 400, 500], [0.01, 0.03, 0.011, 0.035, 0.02])
    assert "r²=" in fit_problem(scattered, 4, 0.8, 0.0)


def test_prediction_and_calibration():
    fit = fit_step_time([0, 1000], [0.008, 0.028])
    # Full-chunk step at 30 decodes + chunk 470 = 500 tokens: 18 ms.
    assert predict_tbt_p99(fit, 30, 470, 1.0) == pytest.approx(0.018)
    assert calibrate_p99_factor(fit, 0.0216, 30, 470) == pytest.approx(1.2)
    assert calibrate_p99_factor(fit, 0.010, 30, 470) == 1.0  # fewer heavy steps than 1 %: stay conservative
    assert calibrate_p99_factor(fit, 1.0, 30, 470) == 4.0  # clamped
    assert calibrate_p99_factor(fit, float("nan"), 30, 470) == 4.0


def test_largest_chunk_within_is_the_closed_form_rounded_down():
    fit = fit_step_time([0, 1000], [0.008, 0.028])  # a = 8 ms, b = 20 µs
    # (27 ms / 1.0 - 8 ms) / 20 µs - 30 = 920 → 896 at granularity 64, 920 at 1.
    assert largest_chunk_within(fit, 30, 1.0, 0.027, 64) == 896
    assert largest_chunk_within(fit, 30, 1.0, 0.027, 1) == 920
    assert largest_chunk_within(fit, 30, 1.0, 0.008, 64) is None  # the decodes alone exceed the budget
    with pytest.raises(FitError):
        largest_chunk_within(fit_step_time([0, 1000], [0.02, 0.01]), 30, 1.0, 0.027, 64)


def test_largest_chunk_within_counts_the_mixed_extra():
    # a = 10 ms, m = 12 ms, b = 25 µs: the full-chunk step is mixed, (45 ms - 22 ms) / 25 µs - 60 = 860 → 832.
    tokens = [40, 60, 80, 600, 1500, 4000]
    fit = fit_step_time(tokens, [0.010 + 25e-6 * t + (0.012 if t > 100 else 0.0) for t in tokens],
                        mixed=[False] * 3 + [True] * 3)
    best = largest_chunk_within(fit, 60, 1.0, 0.045, 64)
    assert best == 832 and predict_tbt_p99(fit, 60, best, 1.0) <= 0.045 < predict_tbt_p99(fit, 60, best + 64, 1.0)


@settings(max_examples=200, deadline=None)
@given(a=st.floats(0.0, 0.05), b=st.floats(1e-7, 1e-4), decodes=st.floats(0, 512), factor=st.floats(1.0, 4.0),
       budget=st.floats(0.001, 0.5), granularity=st.sampled_from([1, 16, 64, 256]))
def test_largest_chunk_is_largest(a, b, decodes, factor, budget, granularity):
    fit = fit_step_time([0, 1000, 2000], [a, a + 1000 * b, a + 2000 * b])
    chunk = largest_chunk_within(fit, decodes, factor, budget, granularity)
    if chunk is None:
        assert predict_tbt_p99(fit, decodes, granularity, factor) > budget * (1 - 1e-9)
    else:
        assert chunk % granularity == 0 and chunk >= granularity
        assert predict_tbt_p99(fit, decodes, chunk, factor) <= budget * (1 + 1e-9)
        assert predict_tbt_p99(fit, decodes, chunk + granularity, factor) > budget * (1 - 1e-9)
        assert math.isfinite(chunk)
