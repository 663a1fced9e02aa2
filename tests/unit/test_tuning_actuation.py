"""The operator's one tuning step (tuning.actuation.tune): the served config read as its prefill budget, the
decision laid out as the next server.yaml generation, and `metronome bench loop` serving exactly what it gives."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from metronome.contract.budget import lane_budgets, prefill_budget
from metronome.contract.config import ConfigError, SchedulerConfig, ServerConfigFile
from metronome.operator import metrics_source as ms
from metronome.operator.tuning.actuation import tune
from metronome.operator.tuning.decision import CurrentConfig
from metronome.operator.tuning.observation import Observation
from metronome.operator.tuning.settings import AutotuneMode, AutotuneSpec, TuningPolicy
from metronome.server.bench.loop import runner as loop

NOW = 1_767_225_600.0
SPEC = AutotuneSpec(tbt_p99_target_s=0.030, mode=AutotuneMode.APPLY, policy=TuningPolicy.MULTIPLICATIVE,
                    policy_switching=False)


def reading(tbt_ms: float) -> Observation:
    return Observation(window_seconds=20, sample_count=5000, tbt_p99_s=tbt_ms / 1000, output_tokens_per_s=900.0,
                       pod_generations={"a": 3})


def served(**scheduler) -> ServerConfigFile:
    return ServerConfigFile(generation=3, scheduler=SchedulerConfig(**scheduler))


def test_a_decision_becomes_the_next_generation():
    tuned = tune(reading(60.0), served(chunk_size=1024, queue_policy="fcfs", max_num_seqs=32), 2, SPEC, NOW)
    assert (tuned.current.chunk_size, tuned.current.generation, tuned.current.replicas) == (1024, 3, 2)
    assert tuned.decision.changed and tuned.decision.chunk_size == 922  # round(1024 x 0.9)
    assert tuned.config.generation == 4 and prefill_budget(tuned.config.scheduler) == 922
    assert tuned.config.scheduler.max_num_seqs == 32 and tuned.problem is None


def test_split_is_read_and_written_as_the_budget_the_engine_enforces():
    crd_defaults = served()  # split, short 2048, long 512: a budget of 2048 (chunk_size 512 is not read)
    tuned = tune(reading(60.0), crd_defaults, 1, SPEC, NOW)
    assert tuned.current.chunk_size == 2048 and tuned.decision.chunk_size == 1843  # round(2048 x 0.9)
    assert lane_budgets(tuned.config.scheduler) == {"short": 1843, "long": 1843}
    assert prefill_budget(tuned.config.scheduler) == tuned.decision.chunk_size


def test_nothing_to_serve_without_a_change():
    held = tune(None, served(chunk_size=1024, queue_policy="fcfs"), 1, SPEC, NOW)
    assert not held.decision.changed and held.config is None and held.problem is None
    # A decision that lays out as the config already served writes nothing either: under split with a ceiling
    # below the short-prompt threshold, 256 lays out as 512 short / 256 long, which is what is served.
    floor = served(chunk_size=256, short_chunk_size=512, long_chunk_size=256)
    again = tune(reading(60.0), floor, 1, replace(SPEC, min_chunk=64, max_chunk=256), NOW)
    assert again.decision.changed and again.config is None


def test_a_decision_no_config_can_carry_is_a_problem_not_a_crash():
    huge = replace(SPEC, min_chunk=(1 << 20) + 64, max_chunk=(1 << 20) + 64)
    tuned = tune(reading(60.0), served(chunk_size=1024, queue_policy="fcfs"), 1, huge, NOW)
    assert tuned.decision.changed and tuned.config is None
    assert "not applied" in tuned.problem and "chunk_size" in tuned.problem


class FakeServer:
    def __init__(self):
        self.written: list[ServerConfigFile] = []

    def write_config(self, config: ServerConfigFile) -> None:
        self.written.append(config)


class FakeFleet:
    """The servers of bench loop's fleet.ServerFleet, without processes: what _control reads and calls."""

    def __init__(self, servers: list[FakeServer]):
        self.live, self.draining, self.scaled = servers, [], []

    @property
    def desired(self) -> int:
        return len(self.live)

    def write_config(self, config: ServerConfigFile) -> None:
        for server in self.live:
            server.write_config(config)

    def scale_to(self, count: int) -> None:
        self.scaled.append(count)


@pytest.mark.parametrize("initial", [(1024, "fcfs"), (2048, "split")])
def test_bench_loop_serves_what_the_operators_step_gives(monkeypatch, initial):
    monkeypatch.setattr(loop, "observe", lambda scrapes, window, now: reading(60.0))
    monkeypatch.setattr(loop.time, "time", lambda: NOW)
    scheduler = loop.initial_scheduler(SchedulerConfig(), *initial)
    plan = loop.RunPlan("loop multiplicative", SPEC, scheduler)
    config = ServerConfigFile(generation=1, scheduler=scheduler)
    servers = [FakeServer(), FakeServer()]
    fleet = FakeFleet(servers)
    state = loop._Loop(plan, config, CurrentConfig.from_scheduler(scheduler, len(servers), 1), fleet)
    settings = loop.LoopSettings(phases=[], requests=[], servers=2, serve_args=(), work_dir=Path("."), interval_s=10,
                                 window=ms.QueryWindow(20, 5), scrape_interval_s=1, slo_tbt_s=0.030, slo_ttft_s=None)

    loop._control(state, settings, due=30.0, now=30.0)

    expected = tune(reading(60.0), config, len(servers), SPEC, NOW)
    assert state.config == expected.config and all(s.written == [expected.config] for s in servers)
    assert state.current == replace(CurrentConfig.from_scheduler(expected.config.scheduler, 2, 2),
                                    last_change_time=NOW)
    (interval,) = state.intervals
    assert interval["chunk_size"] == initial[0] and interval["decision"]["changed"] is True
    assert interval["decision"]["to"] == {"chunk_size": expected.decision.chunk_size, "queue_policy": initial[1],
                                          "servers": 2}
    assert fleet.scaled == [] and interval["servers"] == 2  # scaleReplicas is off: the servers stay


def test_bench_loop_refuses_an_initial_config_that_cannot_be():
    with pytest.raises(ConfigError, match="the initial config"):
        loop.initial_scheduler(SchedulerConfig(), 0, "fcfs")
