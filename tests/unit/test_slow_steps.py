"""Slow engine steps are logged with where their time went, at most one line per interval (server/engine/slow_steps)."""
from __future__ import annotations

import logging

from metronome.contract.config import SchedulerConfig
from metronome.server.engine.outputs import EngineStats, StepStats
from metronome.server.engine.slow_steps import SlowStepLog, describe

STATS = EngineStats(num_running=68, num_waiting={"short": 3, "long": 1}, num_prefilling=2, kv_usage_ratio=0.1,
                    kv_blocks_total=100, kv_blocks_free=90, kv_blocks_leaked=0, preemptions_total=0,
                    scheduler=SchedulerConfig())


def step(ms: float, host_ms: float = 3.0) -> StepStats:
    return StepStats(duration_s=ms / 1e3, scheduler_overhead_s=host_ms / 1e3, num_tokens=516, num_prefill_tokens=512,
                     num_decode_tokens=4, num_seqs=68, forward="piecewise")


def test_describe_splits_host_from_device_time():
    text = describe(step(141.0, host_ms=3.5))
    assert text.startswith("141 ms: host 3.5 ms") and "device and launch 137.5 ms" in text
    assert "piecewise forward, 68 sequences, 516 tokens (512 prefill, 4 decode)" in text
    # Under async scheduling host time can exceed the step's duration: never a negative device share.
    assert "device and launch 0.0 ms" in describe(step(5.0, host_ms=7.0))


def test_only_stalls_are_logged_at_most_once_per_interval(caplog):
    now = [100.0]
    watcher = SlowStepLog(threshold_s=0.1, every_s=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="metronome.server.engine.slow_steps"):
        watcher.on_step(step(60.0), STATS)  # work, not a stall
        assert not caplog.records
        watcher.on_step(step(141.0), STATS)
        now[0] += 2.0
        watcher.on_step(step(180.0), STATS)  # within the interval: counted, not logged
        watcher.on_step(step(120.0), STATS)
        now[0] += 9.0
        watcher.on_step(step(133.0), STATS)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert lines[0].startswith("slow engine step, 141 ms") and "68 running, 4 waiting" in lines[0]
    assert lines[1].startswith("slow engine step, 133 ms") and "(2 more since the last line)" in lines[1]


def test_serve_watches_for_stalls_on_a_gpu_only():
    from metronome.server.api.serve_cli import _stall_loggers

    gpu = _stall_loggers("cuda")  # the engine's device type (either engine mode reports it)
    assert len(gpu) == 1 and isinstance(gpu[0], SlowStepLog)
    assert _stall_loggers("cpu") == []
