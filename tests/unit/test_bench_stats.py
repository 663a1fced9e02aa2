"""Pure statistics of `metronome bench`, on hand-computed cases."""
from __future__ import annotations

import pytest

from metronome.server.bench.load.records import RequestRecord
from metronome.server.bench.load.stats import gaps, is_good, percentile, summarize, ttft


def rec(index, sent, times, error=None, kind="short"):
    return RequestRecord(index=index, kind=kind, max_tokens=len(times), prompt_tokens=10, sent_s=sent,
                         token_times_s=list(times), output_tokens=len(times),
                         end_s=None if error else (times[-1] if times else sent), error=error)


def test_percentile_interpolates_between_closest_ranks():
    assert percentile([4, 1, 3, 2], 50) == pytest.approx(2.5)
    assert percentile([1, 2, 3, 4], 99) == pytest.approx(3.97)  # 3 + 0.97 * (4 - 3)
    assert percentile([1, 2, 3, 4], 0) == 1 and percentile([1, 2, 3, 4], 100) == 4
    assert percentile([7.0], 90) == 7.0
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_gaps_and_ttft():
    r = rec(0, 0.5, [0.7, 0.75, 0.95])
    assert gaps(r.token_times_s) == pytest.approx([0.05, 0.2])
    assert ttft(r) == pytest.approx(0.2)
    assert ttft(rec(1, 0.0, [])) is None


@pytest.fixture
def three():
    return [
        rec(0, 0.0, [0.1, 0.15, 0.25]),  # TTFT 100 ms, gaps 50, 100 ms
        rec(1, 0.5, [0.7, 0.72]),  # TTFT 200 ms, gap 20 ms
        rec(2, 0.6, [], error="http 429: queue full"),
    ]


def test_summary_of_hand_computed_run(three):
    s = summarize(three)
    assert (s.num_requests, s.num_completed, s.num_errors) == (3, 2, 1)
    assert s.error_kinds == {"http 429": 1}
    assert s.duration_s == pytest.approx(0.72)  # first send 0.0 .. last completion 0.72
    assert s.output_tokens == 5 and s.token_stamps == 5
    assert s.output_tokens_per_s == pytest.approx(5 / 0.72)
    assert s.request_throughput == pytest.approx(2 / 0.72)
    assert s.ttft.p50_ms == pytest.approx(150.0) and s.ttft.max_ms == pytest.approx(200.0)
    assert s.tbt.count == 3
    assert s.tbt.p50_ms == pytest.approx(50.0)
    assert s.tbt.p99_ms == pytest.approx(99.0)  # gaps 20, 50, 100: 50 + 0.98 * 50
    assert s.tbt.mean_ms == pytest.approx(170 / 3)
    assert s.e2e.p50_ms == pytest.approx(235.0)  # e2e 250 ms and 220 ms
    assert s.by_kind["short"]["count"] == 2
    assert s.goodput_ratio is None and s.meets_slo is None  # no SLO given


def test_goodput_uses_each_requests_own_p99_and_strict_uses_every_gap(three):
    tight = summarize(three, slo_tbt_ms=60)
    # request 0: p99 of its gaps (50, 100 ms) = 99.5 ms > 60 -> not good; request 1 good; the error is not good
    assert tight.goodput_ratio == pytest.approx(1 / 3)
    assert tight.strict_goodput_ratio == pytest.approx(1 / 3)
    assert tight.goodput_tokens_per_s == pytest.approx(2 / 0.72)
    assert tight.meets_slo is False  # pooled p99 99 ms

    loose = summarize(three, slo_tbt_ms=99.6)
    assert loose.goodput_ratio == pytest.approx(2 / 3)  # 99.5 ms <= 99.6 ms
    assert loose.strict_goodput_ratio == pytest.approx(1 / 3)  # its 100 ms gap > 99.6 ms
    assert loose.meets_slo is True


def test_ttft_slo_also_gates_goodput(three):
    s = summarize(three, slo_tbt_ms=1000, slo_ttft_ms=150)
    assert s.goodput_ratio == pytest.approx(1 / 3)  # request 1 waited 200 ms for its first token
    assert s.meets_slo is False  # TTFT p99 ~199 ms > 150 ms


def test_single_token_request_is_good_and_unsent_ones_do_not_count():
    one = rec(0, 0.0, [0.3])
    assert is_good(one, 0.001)
    never_sent = RequestRecord(index=1, kind="short", max_tokens=4, sent_s=None, error="cancelled: never sent")
    s = summarize([one, never_sent], slo_tbt_ms=10)
    assert s.goodput_ratio == 1.0 and s.tbt.count == 0 and s.tbt.p99_ms is None


def test_empty_run_summarizes_to_zeros():
    s = summarize([], slo_tbt_ms=50)
    assert s.num_requests == 0 and s.output_tokens_per_s == 0.0 and s.ttft.p50_ms is None
    assert s.meets_slo is False and s.goodput_ratio is None
