"""Python's garbage-collector pauses while a benchmark runs.

A collection stops every thread that holds the GIL, the engine's included: a full (generation 2) collection over
the objects of a few hundred live requests takes milliseconds, and every running decode's token waits for it. A
token-weighted TBT p99 above the step p99 can come from a few such steps; this tells them apart from the GPU's.
"""
from __future__ import annotations

import gc
import threading
import time
from typing import Any


class GcPauses:
    """Counts collections and their pauses per generation while registered (`with GcPauses() as pauses:`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._started: float | None = None
        self.pauses: dict[int, list[float]] = {}

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        now = time.perf_counter()
        if phase == "start":
            self._started = now
        elif self._started is not None:
            with self._lock:
                self.pauses.setdefault(info["generation"], []).append(now - self._started)
            self._started = None

    def start(self) -> None:
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)

    def stop(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def __enter__(self) -> GcPauses:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def reset(self) -> None:
        with self._lock:
            self.pauses = {}

    def summary(self) -> dict[str, Any]:
        """Per generation: collections, their total and longest pause in ms."""
        with self._lock:
            pauses = {g: list(p) for g, p in self.pauses.items()}
        return {f"gen{g}": {"collections": len(p), "total_ms": sum(p) * 1e3, "max_ms": max(p) * 1e3}
                for g, p in sorted(pauses.items())}
