"""What a process that runs the engine beside Python threads sets once it is ready, for smooth streams.

Both `serve` (in-process, or each API server of several) and `metronome bench engine` do it, so a benchmark
measures the engine the way it serves.
"""
from __future__ import annotations

import gc
import sys

GIL_SWITCH_INTERVAL_S = 0.0005


def freeze_startup_heap() -> int:
    """Collect once, then move every object alive now (modules, the model, graphs, the app) into the collector's
    permanent generation and return how many. A full collection walks all tracked objects, about 220k after
    start-up: 100-125 ms on the development VM, during which no stream gets a token. Frozen, collections walk
    only what serving allocates (vLLM and SGLang freeze after start-up for the same reason)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def shorten_gil_switch(device_type: str) -> bool:
    """On a GPU: the engine thread shares the GIL with an event loop, and every torch call releases and retakes
    it; at Python's default 5 ms switch interval a busy event loop holds the engine up to 5 ms per call, so a step
    of a few dozen calls stretches while many streams are served. On a CPU both threads compute and the extra
    switching costs more than it saves (docs/perf/serving-cpu.md), so it stays. Returns whether it changed."""
    if device_type != "cuda":
        return False
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    return True
