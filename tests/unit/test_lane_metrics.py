"""The series policy switching and the settling window read: TBT and prompt counts by prompt lane
(short: at most the scheduler's short_prompt_threshold tokens, whatever the policy), and the time the current
config was applied."""
from __future__ import annotations

from collections import Counter

from engine_fakes import fake_engine

from metronome.contract import metric_names as names
from metronome.contract.config import SchedulerConfig
from metronome.server.api.metrics import ServerMetrics
from metronome.server.api.token_gaps import TokenGapTimer
from metronome.server.engine.sampling import SamplingParams


def test_each_gap_and_first_token_carries_its_prompt_lane_under_any_policy():
    engine = fake_engine(chunk_size=64, queue_policy="fcfs", short_prompt_threshold=16)
    metrics = ServerMetrics("m")
    short = engine.add_request([3] * 16, SamplingParams(max_tokens=4, temperature=0.0))  # exactly the threshold
    engine.add_request([5] * 40, SamplingParams(max_tokens=3, temperature=0.0))  # long
    # The routes time the gaps as tokens reach the response (token_gaps.py), with the lanes the engine assigns.
    timer = TokenGapTimer(metrics.observe_token_gap, short_prompt_threshold=16)
    engine_lanes: Counter[str] = Counter()
    while engine.has_unfinished():
        events, stats = engine.step()
        assert len(stats.token_gap_lanes) == len(stats.token_gaps_s)
        assert len(stats.first_token_lanes) == len(stats.first_token_latencies_s)
        engine_lanes.update(stats.token_gap_lanes)
        metrics.on_step(stats, engine.stats())
        for event in events:
            timer.on_event(0 if event.request_id == short else 1, event)

    def value(name, **labels):
        return metrics.registry.get_sample_value(name, {"model": "m", **labels})

    assert engine_lanes == Counter(short=3, long=2)
    assert value(names.TIME_BETWEEN_TOKENS + "_count", lane="short") == 3
    assert value(names.TIME_BETWEEN_TOKENS + "_count", lane="long") == 2
    assert value(names.PROMPTS, lane="short") == 1 and value(names.PROMPTS, lane="long") == 1


def test_the_config_applied_time_moves_only_when_a_config_is_applied():
    import time

    metrics = ServerMetrics("m")

    def applied():
        return metrics.registry.get_sample_value(names.CONFIG_APPLIED_TIME, {"model": "m"})

    assert applied() == 0
    before = time.time()
    metrics.set_config(SchedulerConfig(), 1)
    first = applied()
    assert before <= first <= time.time()
    metrics.refresh(fake_engine().stats())  # a scrape-time refresh is not an apply
    assert applied() == first
    time.sleep(0.01)
    metrics.set_config(SchedulerConfig(chunk_size=256), 2)
    assert applied() > first
    assert metrics.registry.get_sample_value(names.CONFIG_GENERATION, {"model": "m"}) == 2
