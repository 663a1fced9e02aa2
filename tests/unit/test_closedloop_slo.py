"""metronome_testing.closedloop.slo: the CPU run's TBT target from the gaps measured at the initial chunk size."""
from __future__ import annotations

import pytest

from metronome_testing.closedloop.load import require_loopback
from metronome_testing.closedloop.slo import (
    CalibrationError,
    choose_load_step,
    choose_shared_tbt_target,
    choose_tbt_target,
    load_levels,
)


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


def test_the_load_step_puts_a_ttft_bucket_bound_between_one_server_and_two():
    # One server: 7.0 s p99 with 16 clients (all batched), 41 s with 32 (16 waiting for a slot); two servers carry
    # 16 each. [2 x 7.0, 41 / 1.3] = [14, 31.5] holds 20.
    step = choose_load_step({4: 4.2, 16: 7.0, 32: 41.0})
    assert (step.clients, step.limit_s) == (32, 20.0)
    assert step.one_server_s == 41.0 and step.two_servers_s == 7.0
    assert "32 clients" in step.describe() and "limit 20000 ms" in step.describe()


def test_a_server_whose_ttft_barely_grows_is_measured_at_more_clients():
    assert load_levels(4) == [12, 24, 16, 32]
    measured = {4: 4.4, 12: 4.5}
    assert choose_load_step(measured) is None  # 12 needs 6, not measured
    measured[24] = 9.0  # [9, 6.9]: none
    assert choose_load_step(measured) is None
    measured[16] = 6.0
    assert choose_load_step(measured) is None  # 16 needs 8
    measured[32] = 41.0  # [12, 31.5] holds 20
    step = choose_load_step(measured)
    assert (step.clients, step.limit_s, step.two_servers_s) == (32, 20.0, 6.0)


def test_a_step_whose_two_servers_measured_only_1_5x_below_the_limit_is_not_chosen():
    # A quiet run: 6.0 s at 12 clients, 19.1 s at 24, and a 10 s limit between them ([1.5 x 6.0, 19.1 / 1.3]):
    # two servers with 12 each then measured 9.7 s, within 3 % of the limit.
    assert choose_load_step({4: 4.2, 12: 6.0, 24: 19.1}) is None


def test_the_smallest_fitting_load_and_the_bound_nearest_the_middle_are_chosen():
    # 8 clients: [2 x 0.3, 2.0 / 1.3] = [0.6, 1.54] holds 0.75, 1.0, 1.5; the middle is 0.96 → 1.0.
    step = choose_load_step({4: 0.3, 8: 2.0, 16: 9.0})
    assert (step.clients, step.limit_s) == (8, 1.0)
    for two, one in ((0.05, 0.2), (1.2, 5.0), (2.5, 7.0), (9.0, 40.0)):
        step = choose_load_step({4: two, 8: one})
        assert step.two_servers_s * 2.0 <= step.limit_s <= step.one_server_s / 1.3


def test_a_load_step_beyond_the_buckets_is_not_chosen():
    assert choose_load_step({4: 30.0, 8: 90.0}) is None  # two servers need a bound above 60 s; 80 s clamps
    with pytest.raises(CalibrationError):
        choose_load_step({4: 0.0, 8: 1.0})


def test_two_servers_get_a_tbt_target_with_room_for_sharing_the_machine():
    # One server alone measured 678 ms p99 at the chosen chunk: two sharing a 2-core machine need about 3 x that.
    assert choose_shared_tbt_target(0.678, 1.0) == 2.5
    # A fast machine keeps the one-server target when 3 x its p99 is below it, and never gets a smaller one.
    assert choose_shared_tbt_target(0.05, 0.5) == 0.5
    assert choose_shared_tbt_target(0.2, 0.5) == 1.0
    with pytest.raises(CalibrationError, match="no TBT bucket bound"):
        choose_shared_tbt_target(2.0, 1.0)  # 6 s: above 5 s, the largest bound before quantiles clamp
    with pytest.raises(CalibrationError):
        choose_shared_tbt_target(0.0, 1.0)


def test_load_goes_only_to_loopback():
    assert require_loopback("http://127.0.0.7:8000") == "http://127.0.0.7:8000"
    with pytest.raises(ValueError, match="127.0.0.0/8"):
        require_loopback("http://10.0.0.5:8000")
