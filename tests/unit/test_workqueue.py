"""The work queue's rules (operator/workqueue.py): a key queued once however often it is added, never handed to
two workers at once, processed again when it changed meanwhile; delayed keys come when due; shutdown ends get."""
from __future__ import annotations

import threading

from metronome.operator.workqueue import WorkQueue


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_key_added_twice_is_processed_once():
    queue = WorkQueue()
    for _ in range(3):
        queue.add("a")
    queue.add("b")
    assert [queue.get(0), queue.get(0), queue.get(0)] == ["a", "b", None]


def test_a_key_being_processed_goes_to_no_other_worker_and_comes_back_once_if_it_changed():
    queue = WorkQueue()
    queue.add("a")
    assert queue.get(0) == "a"
    queue.add("a")
    queue.add("a")
    assert queue.get(0) is None  # not while it is processed
    queue.done("a")
    assert queue.get(0) == "a"
    queue.done("a")
    assert queue.get(0) is None


def test_delayed_keys_come_when_due():
    clock = Clock()
    queue = WorkQueue(clock=clock)
    queue.add_after("late", 5.0)
    queue.add_after("soon", 1.0)
    assert queue.get(0) is None
    clock.now = 1.0
    assert queue.get(0) == "soon"
    clock.now = 5.0
    assert queue.get(0) == "late"


def test_shutdown_wakes_a_waiting_worker():
    queue = WorkQueue()
    got = []
    worker = threading.Thread(target=lambda: got.append(queue.get()))
    worker.start()
    queue.shutdown()
    worker.join(timeout=5)
    assert got == [None] and not worker.is_alive()
    queue.add("a")
    assert queue.get(0) is None
