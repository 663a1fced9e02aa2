"""The per-client prompt-token bucket (server/api/client_rate.py) with a fake clock."""
from __future__ import annotations

import pytest

from metronome.server.api.client_rate import (
    Bucket,
    ClientRateExceeded,
    RateFlags,
    RateLimiter,
    level,
    wait_seconds,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def limiter(rate: int = 100, burst: int | None = None, max_clients: int = 1000) -> tuple[RateLimiter, Clock]:
    clock = Clock()
    made = RateLimiter.from_flags(RateFlags(rate, burst), clock)
    made.max_clients = max_clients
    return made, clock


def test_no_rate_is_no_limiter_and_the_burst_defaults_to_one_second():
    assert RateLimiter.from_flags(RateFlags()) is None
    assert RateFlags(250).capacity == 250 and RateFlags(250, 40).capacity == 40


@pytest.mark.parametrize(("flags", "match"), [
    ({"burst": 10}, "--prompt-token-burst-per-client needs --max-prompt-tokens-per-second-per-client"),
    ({"tokens_per_second": 0}, "--max-prompt-tokens-per-second-per-client must be >= 1, got 0"),
    ({"tokens_per_second": 5, "burst": 0}, "--prompt-token-burst-per-client must be >= 1, got 0"),
])
def test_bad_flags_name_the_flag(flags, match):
    with pytest.raises(ValueError, match=match):
        RateFlags(**flags)


def test_level_refills_at_the_rate_up_to_the_capacity():
    bucket = Bucket(tokens=-50.0, updated=10.0)
    assert level(bucket, 100.0, 200.0, 10.0) == -50.0
    assert level(bucket, 100.0, 200.0, 11.5) == 100.0
    assert level(bucket, 100.0, 200.0, 60.0) == 200.0


def test_a_new_client_starts_full_and_spends_its_burst():
    rates, clock = limiter(rate=100, burst=200)
    rates.charge("user:a", 150)
    with pytest.raises(ClientRateExceeded) as refused:
        rates.charge("user:a", 60)  # holds 50
    assert refused.value.retry_after_seconds == pytest.approx(0.1)  # 10 tokens at 100/s
    rates.charge("user:a", 50)
    clock.now += 0.3
    rates.charge("user:a", 30)
    assert level(rates.buckets["user:a"], 100, 200, clock.now) == pytest.approx(0.0, abs=1e-6)


def test_clients_have_buckets_of_their_own():
    rates, _ = limiter(rate=100)
    rates.charge("user:a", 100)
    rates.charge("user:b", 100)
    with pytest.raises(ClientRateExceeded):
        rates.charge("user:a", 1)


def test_a_refused_request_is_not_charged():
    rates, clock = limiter(rate=100)
    rates.charge("user:a", 80)
    for _ in range(5):
        with pytest.raises(ClientRateExceeded):
            rates.charge("user:a", 50)
    assert level(rates.buckets["user:a"], 100, 100, clock.now) == pytest.approx(20.0)
    clock.now += 0.3
    rates.charge("user:a", 50)  # 20 + 30 refilled: exactly enough


def test_a_request_larger_than_the_burst_waits_for_a_full_bucket_then_owes_the_rest():
    rates, clock = limiter(rate=100, burst=100)
    rates.charge("user:a", 40)
    with pytest.raises(ClientRateExceeded) as refused:
        rates.charge("user:a", 500)
    assert refused.value.retry_after_seconds == pytest.approx(0.4)  # until full, not until 500
    assert "larger than the burst" in str(refused.value)
    clock.now += 0.4
    rates.charge("user:a", 500)  # admitted: the bucket is full
    assert rates.buckets["user:a"].tokens == pytest.approx(-400.0)
    with pytest.raises(ClientRateExceeded) as owed:
        rates.charge("user:a", 10)
    assert owed.value.retry_after_seconds == pytest.approx(4.1)  # pay back 400, then 10
    assert "400 owed" in str(owed.value)
    clock.now += 4.1
    rates.charge("user:a", 10)


def test_the_long_run_rate_is_the_rate_whatever_the_sizes():
    """Send as fast as allowed for 100 s of fake time: admitted tokens ~ burst + rate x time."""
    rates, clock = limiter(rate=100, burst=100)
    admitted = 0
    sizes = [30, 250, 7, 1000, 64]
    for step in range(10_000):
        clock.now += 0.01
        try:
            rates.charge("user:a", sizes[step % len(sizes)])
            admitted += sizes[step % len(sizes)]
        except ClientRateExceeded:
            pass
    assert 100 * 100 <= admitted <= 100 * 100 + 100 + max(sizes)


def test_a_refund_undoes_the_charge_exactly():
    rates, clock = limiter(rate=100, burst=100)
    rates.charge("user:a", 30)
    charge = rates.charge("user:a", 60)
    clock.now += 0.05
    charge.refund()
    charge.refund()  # idempotent
    assert level(rates.buckets["user:a"], 100, 100, clock.now) == pytest.approx(75.0)  # 100 - 30 + 5
    clock.now += 1
    charge = rates.charge("user:a", 100)
    clock.now += 0.5
    charge.refund()
    assert level(rates.buckets["user:a"], 100, 100, clock.now) == pytest.approx(100.0)  # capped, as uncharged


def test_wait_is_zero_when_enough_and_for_an_empty_request():
    assert wait_seconds(50, 50, 100, 100) == 0
    assert wait_seconds(-500, 0, 100, 100) == 0
    assert wait_seconds(-100, 1, 100, 100) == pytest.approx(1.01)


def test_full_buckets_are_dropped_when_too_many_clients_are_tracked():
    rates, clock = limiter(rate=100, max_clients=8)
    for index in range(8):
        rates.charge(f"user:{index}", 10)
    clock.now += 0.1  # all full again
    rates.charge("user:late", 10)
    assert list(rates.buckets) == ["user:late"]


def test_too_many_clients_in_debt_forgive_the_least_debt_and_stay_bounded():
    rates, clock = limiter(rate=100, max_clients=8)
    for index in range(8):
        rates.charge(f"user:{index}", 10 * (index + 1))  # user:0 is the nearest to full
    rates.charge("user:late", 10)
    assert len(rates.buckets) == 8 * 3 // 4 + 1
    assert "user:0" not in rates.buckets and "user:7" in rates.buckets
    for index in range(10_000):
        rates.charge(f"user:many-{index}", 50)
    assert len(rates.buckets) <= 8


def test_a_long_identity_is_kept_as_a_hash_and_shown_shortened():
    rates, _ = limiter(rate=10)
    name = "user:" + "x" * 10_000
    rates.charge(name, 10)
    (key,) = rates.buckets
    assert key.startswith("sha256:") and len(key) < 100
    with pytest.raises(ClientRateExceeded) as refused:
        rates.charge(name, 5)
    assert len(str(refused.value)) < 400 and "--max-prompt-tokens-per-second-per-client 10" in str(refused.value)


def serve_args(*flags: str):
    import argparse

    from metronome.server.api import serve_cli

    parser = argparse.ArgumentParser()
    serve_cli.configure(parser)
    return parser.parse_args(["--model", "random:tiny", "--device", "cpu", *flags])


def test_serve_takes_the_rate_flags():
    args = serve_args("--max-prompt-tokens-per-second-per-client", "1000", "--prompt-token-burst-per-client", "4000")
    assert (args.max_prompt_tokens_per_second_per_client, args.prompt_token_burst_per_client) == (1000, 4000)
    assert serve_args().max_prompt_tokens_per_second_per_client is None


def test_serve_refuses_a_burst_without_a_rate_naming_both_flags(capsys):
    from metronome.server.api import serve_cli

    assert serve_cli.run(serve_args("--prompt-token-burst-per-client", "4000")) == 2  # before loading a model
    err = capsys.readouterr().err
    assert "--prompt-token-burst-per-client needs --max-prompt-tokens-per-second-per-client" in err


def test_serve_refuses_a_zero_rate_naming_the_flag(capsys):
    with pytest.raises(SystemExit):
        serve_args("--max-prompt-tokens-per-second-per-client", "0")
    assert "--max-prompt-tokens-per-second-per-client: must be >= 1" in capsys.readouterr().err
