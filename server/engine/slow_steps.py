"""A log line for every engine step that stalls (on a GPU: over 100 ms, where a step's work takes 4-60 ms), with
what the step carried and where its time went, so that a stall in production says whether it was the host
(scheduling, preparing inputs, emitting tokens: Python, under the GIL) or the device (the forward and the wait for
its tokens). At most one line per `every_s`; the stalls in between are counted in the next line.
"""
from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from metronome.server.engine.outputs import EngineStats, StepStats

log = logging.getLogger(__name__)

GPU_STALL_S = 0.1  # a bound of metronome_step_duration_seconds: `bench isolation` counts steps over it too


def describe(step: StepStats) -> str:
    """Where a step's time went and what it carried."""
    host = min(step.scheduler_overhead_s, step.duration_s)
    return (f"{step.duration_s * 1e3:.0f} ms: host {host * 1e3:.1f} ms (schedule, prepare, emit), device and "
            f"launch {(step.duration_s - host) * 1e3:.1f} ms; {step.forward} forward, {step.num_seqs} sequences, "
            f"{step.num_tokens} tokens ({step.num_prefill_tokens} prefill, {step.num_decode_tokens} decode), "
            f"{step.num_preemptions} preemptions")


@dataclass
class SlowStepLog:
    """An EngineObserver (engine thread)."""

    threshold_s: float = GPU_STALL_S
    every_s: float = 10.0
    clock: Callable[[], float] = time.monotonic
    _last_logged: float = field(default=-math.inf, init=False)
    _unlogged: int = field(default=0, init=False)

    def on_step(self, step: StepStats, stats: EngineStats) -> None:
        if step.duration_s <= self.threshold_s:
            return
        now = self.clock()
        if now - self._last_logged < self.every_s:
            self._unlogged += 1
            return
        others = f" ({self._unlogged} more since the last line)" if self._unlogged else ""
        log.warning("slow engine step, %s; %d running, %s waiting%s", describe(step), stats.num_running,
                    sum(stats.num_waiting.values()), others)
        self._last_logged, self._unlogged = now, 0

    def on_rejected(self, reason: str) -> None:
        """Rejections carry no step: nothing to log here (the metrics count them)."""
