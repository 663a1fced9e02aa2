"""The experiment's statistics and verdict (operator/experiment/stats.py, verdict.py): exact sign-test bounds,
the pooled error test, and the decisions — a clearly better candidate promoted, a clearly worse one reverted, an
equal one "no difference" rather than flipping, one worse only in TTFT reverted."""
from __future__ import annotations

import math
import random

import pytest

from metronome.operator.experiment.settings import CandidateSpec, ExperimentSpec, Gates
from metronome.operator.experiment.stats import binomial_tail, error_rate_p_value, median_bounds, order_rank
from metronome.operator.experiment.verdict import GroupWindow, Outcome, WindowReading, judge

SPEC = ExperimentSpec(candidate=CandidateSpec({"chunk_size": 256}), windows=10, confidence=0.95,
                      min_improvement=0.05, min_samples=100,
                      gates=Gates(tbt_p99_worse=0.10, ttft_p99_worse=0.10, goodput_lower=0.05))
CONTROL = GroupWindow(tbt_p99_s=0.040, ttft_p99_s=0.500, goodput_per_pod=1000.0, tbt_samples=5000, requests=200,
                      errors=0, pods_seen=2)


def group(tbt=1.0, ttft=1.0, goodput=1.0, **overrides) -> GroupWindow:
    """The control scaled by these ratios, with one pod."""
    values = dict(tbt_p99_s=CONTROL.tbt_p99_s * tbt, ttft_p99_s=CONTROL.ttft_p99_s * ttft,
                  goodput_per_pod=CONTROL.goodput_per_pod * goodput, tbt_samples=2500, requests=100, errors=0,
                  pods_seen=1)
    return GroupWindow(**{**values, **overrides})


def windows(ratios: list[dict], **candidate) -> list[WindowReading]:
    return [WindowReading(i + 1, 1000.0 + 60 * i, group(**r, **candidate), CONTROL) for i, r in enumerate(ratios)]


def jitter(n: int, seed: int, sigma: float, **center) -> list[dict]:
    rng = random.Random(seed)
    return [{k: v * math.exp(rng.gauss(0, sigma)) for k, v in {"tbt": 1.0, "ttft": 1.0, "goodput": 1.0,
                                                                 **center}.items()} for _ in range(n)]


# --- stats --------------------------------------------------------------------------------------------------


def test_binomial_tail_and_order_ranks_are_the_sign_test_tables():
    assert binomial_tail(5, 5) == pytest.approx(1 / 32)
    assert binomial_tail(10, 9) == pytest.approx(11 / 1024)
    assert binomial_tail(4, 0) == 1.0 and binomial_tail(4, 5) == 0.0
    # One-sided 95 %: below 5 windows no bound exists; 5-7 windows use the extremes; 10 windows the second ones.
    assert [order_rank(n, 0.95) for n in (4, 5, 7, 8, 10, 20)] == [None, 1, 1, 2, 2, 6]
    assert order_rank(3, 0.8) == 1 and order_rank(2, 0.8) is None


def test_median_bounds_come_from_order_statistics():
    bounds = median_bounds([1.3, 0.9, 1.1, 1.0, 1.2, 1.4, 0.8, 1.05, 1.15, 0.95], 0.95)
    assert (bounds.n, bounds.median, bounds.lower, bounds.upper) == (10, pytest.approx(1.075), 0.9, 1.3)
    assert not median_bounds([1.0, 2.0], 0.95).known
    assert median_bounds([], 0.95).median is None


def test_error_rate_test_pools_counts():
    # No errors anywhere, or no requests on a side: nothing to test.
    assert error_rate_p_value(0, 100, 0, 100) is None and error_rate_p_value(1, 0, 0, 100) is None
    # 5 errors all on the candidate with half the requests: 1/32.
    assert error_rate_p_value(5, 100, 0, 100) == pytest.approx(1 / 32)
    # Errors in proportion to the requests are unremarkable.
    assert error_rate_p_value(2, 100, 6, 300) > 0.3


# --- verdicts -----------------------------------------------------------------------------------------------


def test_a_clearly_better_candidate_is_promoted_after_five_windows():
    readings = windows(jitter(10, seed=1, sigma=0.05, tbt=0.6, goodput=1.1))
    assert judge(readings[:4], SPEC, 1).outcome is Outcome.MEASURING  # too few windows to be sure of anything
    verdict = judge(readings[:5], SPEC, 1)
    assert (verdict.outcome, verdict.reason, verdict.counted) == (Outcome.PROMOTED, "Better", 5)
    ratios = verdict.ratios()
    assert ratios["tbtP99"]["state"] == "better" and 0.5 < ratios["tbtP99"]["ratio"] < 0.7
    assert ratios["ttftP99"]["state"] in ("within", "better") and ratios["errorRate"]["candidate"] == 0


def test_a_clearly_worse_candidate_is_reverted():
    verdict = judge(windows(jitter(5, seed=2, sigma=0.05, tbt=3.0)), SPEC, 1)
    assert (verdict.outcome, verdict.reason) == (Outcome.REVERTED, "TBTWorse")
    assert verdict.message.startswith("TBT p99 ratio 2.9") and "worse than the +10 % allowed" in verdict.message


def test_a_candidate_worse_only_in_ttft_is_reverted_even_when_tbt_is_better():
    verdict = judge(windows(jitter(6, seed=3, sigma=0.03, tbt=0.5, ttft=1.4)), SPEC, 1)
    assert (verdict.outcome, verdict.reason) == (Outcome.REVERTED, "TTFTWorse")
    assert verdict.ratios()["tbtP99"]["state"] == "better"


def test_lower_goodput_and_more_errors_are_reverted():
    assert judge(windows(jitter(5, seed=4, sigma=0.02, goodput=0.7)), SPEC, 1).reason == "GoodputLower"
    failing = windows(jitter(5, seed=5, sigma=0.02), errors=2)  # 10 errors in 500 requests, the control none
    assert judge(failing, SPEC, 1).reason == "ErrorRateHigher"
    ignored = ExperimentSpec(candidate=SPEC.candidate, gates=Gates(error_rate=False))
    assert judge(failing, ignored, 1).outcome is not Outcome.REVERTED


def test_an_equal_candidate_ends_no_difference_rather_than_flipping():
    verdict = None
    readings = windows(jitter(10, seed=6, sigma=0.05))
    for n in range(1, 11):
        verdict = judge(readings[:n], SPEC, 1)
        assert verdict.outcome is (Outcome.NO_DIFFERENCE if n == 10 else Outcome.MEASURING), (n, verdict.message)
    assert verdict.reason == "NoDifference" and "the control's config stays" in verdict.message


def first_verdict(readings: list[WindowReading]):
    """What an experiment judged window by window ends with: its first decision, or the last verdict."""
    for n in range(1, len(readings) + 1):
        verdict = judge(readings[:n], SPEC, 1)
        if verdict.decided:
            return verdict
    return verdict


def test_equal_candidates_rarely_decide_anything():
    """A/A experiments judged after every window, with 10 % noise per window ratio: a decision needs nearly every
    window beyond a margin (the 10 % tolerance, the 5 % improvement), which noise seldom provides."""
    outcomes = [first_verdict(windows(jitter(10, seed=seed, sigma=0.10))).outcome for seed in range(400)]
    assert sum(outcome is not Outcome.NO_DIFFERENCE for outcome in outcomes) <= 4


def test_a_small_real_difference_is_not_called_better_below_the_margin():
    # 3 % better in every window: real, but smaller than minImprovementPercent (5 %).
    verdict = judge(windows([{"tbt": 0.97}] * 10), SPEC, 1)
    assert verdict.outcome is Outcome.NO_DIFFERENCE


def test_windows_without_enough_data_do_not_count():
    readings = windows(jitter(6, seed=7, sigma=0.02, tbt=0.5))
    starved = [WindowReading(r.index, r.end, group(tbt=0.5, tbt_samples=20), r.control) for r in readings[:2]]
    silent = [WindowReading(r.index, r.end, group(tbt=0.5, pods_seen=1), r.control) for r in readings[2:4]]
    verdict = judge([*starved, *silent, *readings[4:]], SPEC, candidate_pods=2)
    assert (verdict.outcome, verdict.counted, verdict.skipped) == (Outcome.MEASURING, 0, 6)
    assert "1 of 2 candidate pods served traffic" in verdict.last_problem
    assert "20 token gaps, fewer than minSamplesPerWindow 100" in judge(starved, SPEC, 1).last_problem
