"""The long-short benchmark's step summary: the step time token gaps wait (weighted per gap) against the step p99,
and the garbage collector's pauses."""
from __future__ import annotations

import gc
from types import SimpleNamespace

import pytest

from metronome.server.bench.engine.gc_pauses import GcPauses
from metronome.server.bench.engine.sections import StepCollector


def step(duration_s: float, gaps: int, tokens: int = 100) -> SimpleNamespace:
    return SimpleNamespace(duration_s=duration_s, scheduler_overhead_s=0.001, num_tokens=tokens, num_preemptions=0,
                           token_gaps_s=[duration_s] * gaps)


def test_a_few_slow_steps_with_many_decodes_set_the_per_gap_p99_not_the_step_p99():
    collector = StepCollector()
    for _ in range(995):
        collector.on_step(step(0.020, gaps=10), None)
    for _ in range(5):  # 0.5 % of the steps, but 200 decodes each: 9 % of the gaps
        collector.on_step(step(0.040, gaps=200), None)
    collector.on_step(step(0.001, gaps=0, tokens=0), None)  # an idle step is not a step
    summary = collector.summary()
    assert summary["steps"] == 1000
    assert summary["step_ms_p99"] == pytest.approx(20.0)
    assert summary["step_ms_p99_per_gap"] == pytest.approx(40.0)
    assert summary["step_ms_max"] == pytest.approx(40.0)
    collector.reset()
    assert collector.summary() == {"steps": 0}


def test_gc_pauses_are_counted_per_generation_while_started():
    pauses = GcPauses()
    gc.collect()
    assert pauses.summary() == {}
    with pauses:
        gc.collect()
        gc.collect(0)
    gc.collect()  # after stop: not counted
    summary = pauses.summary()
    assert summary["gen2"]["collections"] == 1 and summary["gen2"]["max_ms"] >= 0
    assert summary["gen0"]["collections"] >= 1
    assert pauses._callback not in gc.callbacks
    pauses.reset()
    assert pauses.summary() == {}


def test_the_collector_reports_the_pauses_of_its_run():
    collector = StepCollector()
    collector.gc.start()
    try:
        collector.on_step(step(0.02, gaps=3), None)
        gc.collect()
    finally:
        collector.gc.stop()
    assert collector.summary()["gc_pauses"]["gen2"]["collections"] == 1
