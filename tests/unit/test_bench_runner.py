"""The load runner against a scripted client: patterns, stop rules, and that every run stops by itself."""
from __future__ import annotations

import asyncio
import itertools
import math
import time

import pytest

from metronome.server.bench.load.runner import LoadPattern, StopRule, run_load
from metronome.server.bench.load.workloads import (
    BenchRequest,
    TokenSampler,
    WorkloadError,
    WorkloadSpec,
    iter_requests,
    poisson_arrivals,
)

SAMPLER = TokenSampler(vocab_size=512, excluded=frozenset({0, 1, 2}))


class ScriptedClient:
    """Streams `max_tokens` tokens a few ms apart; requests whose index is in `hang` never finish; `fail` raise."""

    def __init__(self, hang=(), fail=()):
        self.hang, self.fail = set(hang), set(fail)
        self.in_flight = 0
        self.max_in_flight = 0

    async def send(self, request, record, t0):
        record.sent_s = time.monotonic() - t0
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if request.index in self.fail:
                raise ConnectionError("connection reset")
            if request.index in self.hang:
                await asyncio.Event().wait()
            for _ in range(request.max_tokens):
                await asyncio.sleep(0.001)
                record.token_times_s.append(time.monotonic() - t0)
            record.output_tokens = request.max_tokens
            record.end_s = time.monotonic() - t0
        finally:
            self.in_flight -= 1


def short_requests(n=None, max_tokens=3):
    reqs = (BenchRequest(index=i, max_tokens=max_tokens, kind="short", prompt_token_ids=(5, 6)) for i in
            itertools.count())
    return itertools.islice(reqs, n) if n is not None else reqs


async def test_fixed_concurrency_keeps_exactly_n_in_flight():
    client = ScriptedClient()
    result = await run_load(client, short_requests(), LoadPattern(concurrency=3), StopRule(num_requests=12))
    assert len(result.records) == 12 and all(r.ok for r in result.records)
    assert client.max_in_flight == 3
    assert sorted(r.index for r in result.records) == list(range(12))
    assert all(len(r.token_times_s) == 3 and r.output_tokens == 3 for r in result.records)


async def test_rate_mode_follows_the_poisson_schedule():
    client = ScriptedClient()
    result = await run_load(client, short_requests(), LoadPattern(rate=500.0), StopRule(num_requests=8), seed=4)
    expected = list(itertools.islice(poisson_arrivals(500.0, 4), 8))
    assert [r.scheduled_s for r in result.records] == expected
    assert all(r.sent_s >= r.scheduled_s for r in result.records)  # never early


async def test_duration_bounds_sending_deterministically():
    client = ScriptedClient()
    result = await run_load(client, short_requests(), LoadPattern(rate=400.0), StopRule(duration_s=0.05), seed=1)
    expected = [t for t in itertools.takewhile(lambda t: t < 0.05, poisson_arrivals(400.0, 1))]
    assert [r.scheduled_s for r in result.records] == expected
    assert all(r.ok for r in result.records)


async def test_closed_loop_duration_stops_by_itself():
    client = ScriptedClient()
    result = await run_load(client, short_requests(), LoadPattern(concurrency=2), StopRule(duration_s=0.03))
    assert result.records and all(r.scheduled_s < 0.03 for r in result.records)
    assert all(r.ok for r in result.records)


async def test_hung_requests_are_cancelled_after_the_drain_and_recorded():
    client = ScriptedClient(hang={1})
    result = await run_load(client, short_requests(), LoadPattern(rate=math.inf),
                            StopRule(num_requests=3, drain_timeout_s=0.05))
    by_index = {r.index: r for r in result.records}
    assert by_index[0].ok and by_index[2].ok
    assert by_index[1].error.startswith("cancelled") and not by_index[1].ok


async def test_request_timeout_and_client_errors_do_not_stop_the_run():
    client = ScriptedClient(hang={0}, fail={1})
    result = await run_load(client, short_requests(), LoadPattern(concurrency=2),
                            StopRule(num_requests=4, request_timeout_s=0.05))
    by_index = {r.index: r for r in result.records}
    assert by_index[0].error.startswith("timeout")
    assert by_index[1].error == "ConnectionError: connection reset"
    assert by_index[2].ok and by_index[3].ok


@pytest.mark.parametrize("pattern", [LoadPattern(rate=100.0), LoadPattern(concurrency=2)])
async def test_a_finite_workload_ends_the_run(pattern):
    client = ScriptedClient()
    result = await run_load(client, short_requests(5), pattern, StopRule(num_requests=50))
    assert len(result.records) == 5


async def test_workload_requests_flow_through():
    spec = WorkloadSpec("long-short")
    client = ScriptedClient()
    result = await run_load(client, iter_requests(spec, SAMPLER, 0), LoadPattern(concurrency=4),
                            StopRule(num_requests=6))
    assert {r.prompt_tokens for r in result.records} <= {50, 2000}
    assert all(r.max_tokens == 128 for r in result.records)


def test_bad_patterns_and_stop_rules():
    with pytest.raises(WorkloadError, match="exactly one"):
        LoadPattern(rate=1.0, concurrency=2)
    with pytest.raises(WorkloadError, match="exactly one"):
        LoadPattern()
    with pytest.raises(WorkloadError):
        LoadPattern(concurrency=0)
    with pytest.raises(WorkloadError, match="stop by itself"):
        StopRule()
    with pytest.raises(WorkloadError):
        StopRule(num_requests=0)
    assert StopRule(duration_s=2.0).expected_requests(LoadPattern(rate=5.0)) == 10
    assert StopRule(num_requests=7).expected_requests(LoadPattern(concurrency=3)) == 7
