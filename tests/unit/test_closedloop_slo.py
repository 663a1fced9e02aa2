"""metronome_testing.closedloop.slo: the CPU run's TBT target from the gaps measured at the initial chunk size."""
from __future__ import annotations

import pytest

from metronome_testing.closedloop.load import require_loopback
from metronome_testing.closedloop.slo import (
    CalibrationError,
    choose_load_step,
    choose_shared_tbt_target,
    choose_tbt_target,
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
    # 6.7 s with 4 clients (a busy CI machine): 8 clients give one server ~13.4 s and two ~6.7 s; 10 s lies in
    # [1.4 x 6.7, 13.4 / 1.2]. The old limit there, 14.2 s, sat inside the 10-20 s bucket, where a few slow first
    # tokens read as a p99 near 20 s on two servers.
    step = choose_load_step(6.7, 4)
    assert (step.clients, step.limit_s) == (8, 10.0)
    assert step.one_server_s == pytest.approx(13.4) and step.two_servers_s == pytest.approx(6.7)
    assert "8 clients" in step.describe() and "limit 10000 ms" in step.describe()


def test_the_load_steps_further_when_no_bound_fits_at_twice_the_clients():
    # 4.1 s: at 8 clients the band [1.4 x 4.1, 8.2 / 1.3] = [5.74, 6.31] holds no bound (5, 7.5), nor at 9
    # clients [6.46, 7.10]; 10 clients: [7.18, 7.88] holds 7.5.
    step = choose_load_step(4.1, 4)
    assert (step.clients, step.limit_s) == (10, 7.5)
    # 5.44 s (a CI run): 9 clients put one server only 1.22x over a 10 s limit; 10 clients, 1.36x.
    step = choose_load_step(5.444, 4)
    assert (step.clients, step.limit_s) == (10, 10.0)
    for base in (0.05, 0.3, 1.2, 2.5, 3.3, 9.0, 14.0):
        step = choose_load_step(base, 4)
        assert step.two_servers_s * 1.4 <= step.limit_s <= step.one_server_s / 1.3


def test_a_load_step_beyond_the_buckets_is_refused():
    with pytest.raises(CalibrationError, match="no TTFT bucket bound"):
        choose_load_step(30.0, 4)  # two servers would need a bound above 40 s, and 80 s is where quantiles clamp
    with pytest.raises(CalibrationError):
        choose_load_step(0.0, 4)


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
