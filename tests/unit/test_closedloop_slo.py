"""metronome_testing.closedloop.slo: the CPU run's TBT target from the gaps measured at the initial chunk size."""
from __future__ import annotations

import pytest

from metronome_testing.closedloop.load import require_loopback
from metronome_testing.closedloop.slo import CalibrationError, choose_tbt_target


def test_an_idle_machine_gets_a_tight_bucket_bound():
    # median 100 ms, p99 870 ms at chunk 512: 1.5 ms per token, 148 ms predicted at chunk 32.
    calibration = choose_tbt_target(0.100, 0.870, 512, 32)
    assert calibration.per_token_s == pytest.approx(0.0015039, rel=1e-3)
    assert calibration.floor_p99_s == pytest.approx(0.1481, rel=1e-3)
    assert calibration.target_s == 0.5  # largest bound with 1.5 x 0.5 <= 0.87 and >= 1.25 x 0.148


def test_a_busy_machine_gets_a_looser_one_but_never_the_largest_finite_bound():
    calibration = choose_tbt_target(0.500, 4.370, 512, 32)
    assert calibration.target_s == 2.5  # largest bound with 1.5 x 2.5 <= 4.37 and >= 1.25 x 0.742
    assert "target 2500 ms" in calibration.describe()
    # With the largest finite bound (where histogram_quantile clamps) in reach, it is still never chosen.
    clamped = choose_tbt_target(0.500, 4.370, 512, 32, buckets=(0.5, 1.0, 2.5))
    assert clamped.target_s == 1.0


def test_a_flat_response_is_refused_with_the_numbers():
    with pytest.raises(CalibrationError, match="median gap 500 ms, p99 600 ms"):
        choose_tbt_target(0.5, 0.6, 512, 32)
    with pytest.raises(CalibrationError):
        choose_tbt_target(0.0, 0.6, 512, 32)
    with pytest.raises(CalibrationError):
        choose_tbt_target(0.1, 0.6, 32, 64)


def test_load_goes_only_to_loopback():
    assert require_loopback("http://127.0.0.7:8000") == "http://127.0.0.7:8000"
    with pytest.raises(ValueError, match="127.0.0.0/8"):
        require_loopback("http://10.0.0.5:8000")
