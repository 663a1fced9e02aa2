"""Waiting queues, one layout per queue policy, and the prefill lanes each policy offers a step.

A lane is a queue plus the prefill budget its prompts may use in one step:
- fcfs: one queue in arrival order; its prompts share `chunk_size`.
- split: prompts of at most `short_prompt_threshold` tokens wait in "short", are served first and admitted whole
  within `short_chunk_size`; longer prompts wait in "long" and advance by at most `long_chunk_size` per step.
- sjf: one queue, shortest prompt first; the key shrinks with waiting time so that nothing starves:
  key = prompt_len * max(0, 1 - waited / sjf_aging_seconds), ties by arrival.
"""
from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass

from metronome.contract.budget import prefill_budget
from metronome.contract.config import QueuePolicy, SchedulerConfig
from metronome.server.engine.sequence import Sequence, SequenceStatus


class ArrivalQueue:
    """Sequences in arrival order; a preempted sequence goes back to its arrival place (ahead of newer ones)."""

    def __init__(self) -> None:
        self._items: list[Sequence] = []
        self._orders: list[int] = []

    def push(self, seq: Sequence) -> None:
        if not self._orders or self._orders[-1] < seq.order:
            self._items.append(seq)
            self._orders.append(seq.order)
            return
        i = bisect.bisect_left(self._orders, seq.order)
        self._items.insert(i, seq)
        self._orders.insert(i, seq.order)

    def peek(self, now: float) -> Sequence | None:
        return self._items[0] if self._items else None

    def remove(self, seq: Sequence) -> bool:
        i = bisect.bisect_left(self._orders, seq.order)
        if i < len(self._items) and self._items[i] is seq:
            del self._items[i]
            del self._orders[i]
            return True
        return False

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(list(self._items))


class ShortestFirstQueue(ArrivalQueue):
    """peek() returns the sequence with the smallest aged prompt length."""

    def __init__(self, aging_seconds: float) -> None:
        super().__init__()
        self.aging_seconds = aging_seconds

    def key(self, seq: Sequence, now: float) -> tuple[float, int]:
        waited = max(0.0, now - seq.arrival_time)
        return prefill_size(seq) * max(0.0, 1.0 - waited / self.aging_seconds), seq.order

    def peek(self, now: float) -> Sequence | None:
        if not self._items:
            return None
        return min(self._items, key=lambda s: self.key(s, now))


def prefill_size(seq: Sequence) -> int:
    """Tokens the sequence prefills on (re)admission: what policies sort and classify by."""
    return seq.prefill_target if seq.status is SequenceStatus.RUNNING else seq.num_tokens


@dataclass
class Lane:
    name: str
    queue: ArrivalQueue
    budget: int  # prefill tokens this lane may use per step
    admit_whole: bool  # admit a new prompt only if all of it fits this step's remaining budget


class WaitingQueues:
    """The queues of one policy and how a step draws prefill work from them."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.policy = QueuePolicy(config.queue_policy)
        # Prefill tokens one step may carry: the contract's number, which every view of the config reports.
        self.prefill_budget = prefill_budget(config)
        if self.policy is QueuePolicy.SPLIT:
            self.lanes = [
                Lane("short", ArrivalQueue(), config.short_chunk_size, admit_whole=True),
                Lane("long", ArrivalQueue(), config.long_chunk_size, admit_whole=False),
            ]
        elif self.policy is QueuePolicy.SJF:
            self.lanes = [Lane("sjf", ShortestFirstQueue(config.sjf_aging_seconds), self.prefill_budget, False)]
        else:
            self.lanes = [Lane("fcfs", ArrivalQueue(), self.prefill_budget, admit_whole=False)]
        self._by_name = {lane.name: lane for lane in self.lanes}

    def lane_of(self, seq: Sequence) -> str:
        if self.policy is QueuePolicy.SPLIT:
            return "short" if prefill_size(seq) <= self.config.short_prompt_threshold else "long"
        return self.lanes[0].name

    def add(self, seq: Sequence) -> None:
        """New or preempted sequence: goes to its queue at its arrival place."""
        seq.lane = self.lane_of(seq)
        self._by_name[seq.lane].queue.push(seq)

    def remove(self, seq: Sequence) -> bool:
        lane = self._by_name.get(seq.lane or "")
        return lane is not None and lane.queue.remove(seq)

    def in_arrival_order(self) -> list[Sequence]:
        return sorted((seq for lane in self.lanes for seq in lane.queue), key=lambda s: s.order)

    def counts(self) -> dict[str, int]:
        return {lane.name: len(lane.queue) for lane in self.lanes}

    def __len__(self) -> int:
        return sum(len(lane.queue) for lane in self.lanes)
