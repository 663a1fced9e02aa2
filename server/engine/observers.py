"""What watches the engine (metrics, the slow-step log), and how both engine front ends (async_engine.py,
engine_process.py) call it: an observer's failure is logged, never raised into serving."""
from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

from metronome.server.engine.outputs import EngineStats, StepStats

log = logging.getLogger(__name__)


class EngineObserver(Protocol):
    def on_step(self, step: StepStats, stats: EngineStats) -> None: ...  # engine thread, after every step

    def on_rejected(self, reason: str) -> None: ...  # "overloaded" | "invalid"


def notify_step(observers: Sequence[EngineObserver], step: StepStats, stats: EngineStats) -> None:
    for observer in observers:
        try:
            observer.on_step(step, stats)
        except Exception:  # an observer must never break serving
            log.exception("observer on_step failed")


def notify_rejected(observers: Sequence[EngineObserver], reason: str) -> None:
    for observer in observers:
        try:
            observer.on_rejected(reason)
        except Exception:  # an observer must never break serving
            log.exception("observer on_rejected failed")
