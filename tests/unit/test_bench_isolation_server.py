"""`bench isolation`'s per-phase server view: deltas of real /metrics scrapes between phase boundaries."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from metronome.server.api.metrics import ServerMetrics
from metronome.server.bench.robustness.isolation_server import (
    format_server_table,
    phase_delta,
    phase_deltas,
    scrape_metrics,
    summarize,
    view_dict,
)


def observe(metrics: ServerMetrics, tbt: dict[str, list[float]] | None = None,
            steps: list[tuple[str, float, int]] = ()) -> str:
    """Observe TBT gaps by lane and steps (kind, seconds, tokens) on the server's registry; return /metrics."""
    for lane, gaps in (tbt or {}).items():
        for gap in gaps:
            metrics.tbt.labels("m", lane).observe(gap)
    for kind, seconds, tokens in steps:
        metrics.step_duration.labels("m", kind).observe(seconds)
        metrics.step_tokens.labels("m", kind).observe(tokens)
    return metrics.render().decode()


def test_a_phase_counts_only_what_happened_between_its_scrapes_and_sums_the_lanes():
    metrics = ServerMetrics("m")
    start = observe(metrics, {"long": [0.15] * 1000}, [("mixed", 0.5, 512)] * 10)  # before the phase: left out
    end = observe(metrics, {"short": [0.003] * 50, "long": [0.005] * 50})

    view = summarize([phase_delta(start, end)])

    assert view.tbt_observations == 100
    # lanes summed: 50 in (2, 4] ms and 50 in (4, 6] ms; rank 99 lies 49/50 into (4, 6] (the long lane alone: 5.98)
    assert view.server_tbt_p99_ms == pytest.approx(5.96)
    assert view.steps == {"decode": 0, "mixed": 0} and view.step_mean_ms == {"decode": None, "mixed": None}
    assert view.steps_over_100ms == 0 and view.mixed_share is None and view.mixed_step_tokens_mean is None


def test_steps_by_kind_their_mean_duration_long_steps_and_tokens_per_mixed_step():
    metrics = ServerMetrics("m")
    start = observe(metrics, steps=[("decode", 0.3, 4)])  # a long step before the phase is not this phase's
    end = observe(metrics, steps=[("decode", 0.004, 4), ("decode", 0.006, 4), ("decode", 0.1, 4),
                                  ("mixed", 0.05, 260), ("mixed", 0.25, 516)])

    view = summarize([phase_delta(start, end)])

    assert view.steps == {"decode": 3, "mixed": 2}
    assert view.step_mean_ms == {"decode": pytest.approx(36.667), "mixed": pytest.approx(150.0)}
    assert view.mixed_share == pytest.approx(0.4)
    assert view.steps_over_100ms == 1  # 100 ms itself is not over; the 300 ms step was before the phase
    assert view.mixed_step_tokens_mean == pytest.approx(388.0)
    assert view.server_tbt_p99_ms is None and view.phases == 1 and view.phases_missing == 0


def test_phases_of_one_kind_add_their_buckets_before_the_quantile():
    metrics = ServerMetrics("m")
    texts = [observe(metrics), observe(metrics, {"short": [0.003] * 100}), observe(metrics, {"short": [0.014] * 100})]
    first, second = phase_deltas(texts)

    assert summarize([first]).server_tbt_p99_ms == pytest.approx(3.98)
    assert summarize([second]).server_tbt_p99_ms == pytest.approx(14.975)
    # together: 200 gaps, rank 198 lies 98/100 into (12.5, 15] ms; not the mean of the two p99s
    assert summarize([first, second]).server_tbt_p99_ms == pytest.approx(14.95)


def test_a_failed_scrape_leaves_the_phases_it_bounds_without_a_view_and_says_so():
    metrics = ServerMetrics("m")
    a = observe(metrics, {"short": [0.003]})
    b = observe(metrics, {"short": [0.003] * 10}, [("decode", 0.004, 4)])
    deltas = phase_deltas([a, b, None, observe(metrics)])

    assert deltas[0] is not None and deltas[1] is None and deltas[2] is None
    quiet = view_dict([deltas[0], deltas[2]])
    assert quiet["phases"] == 1 and quiet["phases_missing"] == 1 and quiet["steps"]["decode"] == 1
    empty = view_dict([deltas[1]])
    assert empty["phases"] == 0 and empty["server_tbt_p99_ms"] is None and empty["mixed_share"] is None

    table = format_server_table([("quiet", quiet), ("hostile", empty), (" burst", empty)])
    assert "server view missing for 2 phase(s)" in table
    assert table.splitlines()[1].split()[:4] == ["quiet", "1", "3.980", "4.000"]


def test_scrape_metrics_gives_none_when_the_server_errs_or_is_unreachable():
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "down":
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(500 if request.url.host == "sick" else 200, text="ok")

    async def run() -> list[str | None]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return [await scrape_metrics(client, f"http://{host}") for host in ("up", "sick", "down")]

    assert asyncio.run(run()) == ["ok", None, None]
