"""What `serve` decides at start-up for smooth streams: a frozen start-up heap (full collections walk only what
serving allocates: no 100 ms pauses) and, on the CPU, a core left for the event loop."""
import gc
import weakref

import pytest

from metronome.server.api.serve_cli import cpu_engine_threads
from metronome.server.engine.serving_process import freeze_startup_heap


@pytest.fixture
def unfrozen():
    gc.unfreeze()
    yield
    gc.unfreeze()  # leave the test process as it was: later tests' garbage must stay collectable


class _Node:
    __slots__ = ("peer", "__weakref__")

    def __init__(self):
        self.peer = self


def test_live_objects_leave_the_walked_generations_and_garbage_is_collected_first(unfrozen):
    live = [_Node() for _ in range(1000)]
    garbage = _Node()
    gone = weakref.ref(garbage)
    del garbage  # a cycle: only the collector frees it
    walked_before = len(gc.get_objects())

    frozen = freeze_startup_heap()

    assert frozen >= len(live)
    # Nothing joins the permanent generation after the freeze; objects leave it only when freed (other threads of
    # this process may free some between the two readings).
    assert 0 < gc.get_freeze_count() <= frozen
    walked = gc.get_objects()
    assert len(walked) < walked_before / 10
    assert not any(o is live[0] for o in walked)
    assert gone() is None  # the cycle was collected before the freeze, not made permanent


def test_objects_made_after_the_freeze_are_still_collected(unfrozen):
    freeze_startup_heap()
    collected_before = sum(s["collected"] for s in gc.get_stats())
    for _ in range(100):
        _Node()  # cycles made while serving
    gc.collect()
    assert sum(s["collected"] for s in gc.get_stats()) - collected_before >= 100


@pytest.mark.parametrize(("cpus", "threads"), [(1, 1), (2, 1), (16, 15)])
def test_a_cpu_engine_leaves_one_core_for_the_event_loop(cpus, threads):
    assert cpu_engine_threads(cpus) == threads
