"""A work queue of keys (namespace, name) with client-go's rules: a key is queued at most once however often it is
added; a key being processed is never handed to a second worker, and one added meanwhile is processed once more
afterwards; `add_after` queues a key later (the control loop's next reading, a back-off after a failure).

Every watch event of an InferenceService or one of its children adds its key, and one reconcile then serves every
change that arrived since: one reconcile per change at most, never two at once for one service.
"""
from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable, Hashable

Key = Hashable


class WorkQueue:
    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._cond = threading.Condition()
        self._queue: list[Key] = []  # FIFO of dirty keys not being processed
        self._dirty: set[Key] = set()  # queued, or to be queued again when processing ends
        self._processing: set[Key] = set()
        self._delayed: list[tuple[float, int, Key]] = []  # (when, tie-breaker, key)
        self._tie = itertools.count()
        self._shutdown = False

    def add(self, key: Key) -> None:
        with self._cond:
            self._add_locked(key)

    def _add_locked(self, key: Key) -> None:
        if self._shutdown or key in self._dirty:
            return
        self._dirty.add(key)
        if key not in self._processing:
            self._queue.append(key)
            self._cond.notify()

    def add_after(self, key: Key, delay_s: float) -> None:
        if delay_s <= 0:
            self.add(key)
            return
        with self._cond:
            if not self._shutdown:
                heapq.heappush(self._delayed, (self._clock() + delay_s, next(self._tie), key))
                self._cond.notify()

    def get(self, timeout_s: float | None = None) -> Key | None:
        """The next key to process (the caller must call `done(key)`), or None once shut down (or after
        `timeout_s` with nothing to do)."""
        deadline = None if timeout_s is None else self._clock() + timeout_s
        with self._cond:
            while True:
                self._release_due_locked()
                if self._shutdown:
                    return None
                if self._queue:
                    key = self._queue.pop(0)
                    self._dirty.discard(key)
                    self._processing.add(key)
                    return key
                now = self._clock()
                waits = [self._delayed[0][0] - now] if self._delayed else []
                if deadline is not None:
                    if now >= deadline:
                        return None
                    waits.append(deadline - now)
                self._cond.wait(min(waits) if waits else None)

    def _release_due_locked(self) -> None:
        now = self._clock()
        while self._delayed and self._delayed[0][0] <= now:
            _, _, key = heapq.heappop(self._delayed)
            self._add_locked(key)

    def done(self, key: Key) -> None:
        with self._cond:
            self._processing.discard(key)
            if key in self._dirty:
                self._queue.append(key)
                self._cond.notify()

    def shutdown(self) -> None:
        with self._cond:
            self._shutdown = True
            self._cond.notify_all()

    def __len__(self) -> int:
        with self._cond:
            return len(self._queue)
