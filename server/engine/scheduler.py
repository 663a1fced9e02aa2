"""Stall-free step planning (Sarathi-Serve): what runs in the next forward pass.

Every step carries, in this order:
1. one token for every running decode - never dropped to make room for prefill (only KV preemption removes one);
2. continuing partial prefills;
3. new prompts from the waiting queues, per the queue policy (see queues.py),
within one prefill budget (`chunk_size`, or the split lanes' sizes) on top of the decodes, capped by
`max_num_batched_tokens` if set, and at most `max_num_seqs` running sequences. When a decode needs a block and
none is free, the newest running sequence is preempted (recompute: its blocks are freed and it waits again).

Pure decision logic over Sequences and a BlockManager: no model, no clock unless given, no I/O.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from metronome.contract.config import SchedulerConfig
from metronome.server.engine.block_manager import BlockManager, KVCacheError
from metronome.server.engine.queues import WaitingQueues
from metronome.server.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    entries: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens to compute this step)
    num_decode_tokens: int = 0
    num_prefill_tokens: int = 0
    prefill_budget: int = 0  # prefill tokens this step was allowed (after the token cap)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return self.num_decode_tokens + self.num_prefill_tokens

    @property
    def num_seqs(self) -> int:
        return len(self.entries)

    @property
    def is_empty(self) -> bool:
        return not self.entries


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 clock: Callable[[], float] = time.monotonic, long_rope_from: int | None = None):
        """long_rope_from: for a LongRoPE model, the original context; a longer sequence is computed with the long
        factors, every position of it (a decode that crosses it is recomputed), as transformers does."""
        self.config = config
        self.block_manager = block_manager
        self.long_rope_from = long_rope_from
        self.clock = clock
        self.queues = WaitingQueues(config)
        self.running: list[Sequence] = []  # admission order: the last one is the newest (first to preempt)
        # Finished while a step that computes them is still in flight (async scheduling): no longer scheduled,
        # their blocks are freed by release() once that step's results are read.
        self.retiring: list[Sequence] = []
        self.preemptions_total = 0

    # --- requests ------------------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.queues.add(seq)

    @property
    def num_waiting(self) -> int:
        return len(self.queues)

    def waiting_counts(self) -> dict[str, int]:
        return self.queues.counts()

    def live_sequences(self) -> list[Sequence]:
        """Every sequence that holds KV blocks."""
        return self.running + self.retiring

    def remove(self, seq: Sequence) -> bool:
        """Drop seq wherever it is (finish or abort) and free its blocks. False if it was not here."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.block_manager.free(seq)
            return True
        if seq.status is SequenceStatus.WAITING:
            return self.queues.remove(seq)
        return False

    def retire(self, seq: Sequence) -> None:
        """Stop scheduling a running seq but keep its blocks until release(seq) (a step in flight writes them)."""
        self.running.remove(seq)
        self.retiring.append(seq)

    def release(self, seq: Sequence) -> None:
        """Free the blocks of a retired seq."""
        self.retiring.remove(seq)
        self.block_manager.free(seq)

    def reconfigure(self, config: SchedulerConfig) -> None:
        """Swap policy and sizes between steps: waiting requests move to the new queues in arrival order;
        running ones (partial prefills included) keep going."""
        waiting = self.queues.in_arrival_order()
        self.config = config
        self.queues = WaitingQueues(config)
        for seq in waiting:
            self.queues.add(seq)
        for seq in self.running:
            seq.lane = self.queues.lane_of(seq)

    # --- the step plan -------------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        self._schedule_decodes(batch)
        prefill_budget = self.queues.prefill_budget
        cap = self.config.max_num_batched_tokens
        if cap is not None:
            prefill_budget = max(0, min(prefill_budget, cap - batch.num_decode_tokens))
        batch.prefill_budget = prefill_budget
        remaining = prefill_budget
        admission_open = True
        stalled = False  # a running prefill got no window blocks this step
        now = self.clock()
        bm = self.block_manager
        for lane in self.queues.lanes:
            lane_left = min(lane.budget, remaining)
            lane_used = 0
            for seq in self.running:  # 2. continuing partial prefills of this lane, oldest first
                if lane_left <= 0:
                    break
                if seq.lane != lane.name or not seq.is_prefilling:
                    continue
                # Window layers hold blocks only around the tokens to compute: they may have fewer slots free.
                n = bm.reserve(seq, min(seq.num_uncomputed_tokens, lane_left))
                if n == 0:
                    stalled, admission_open = True, False
                    continue
                batch.entries.append((seq, n))
                lane_left -= n
                lane_used += n
            while admission_open and lane_left > 0 and len(self.running) < self.config.max_num_seqs:  # 3. new
                seq = lane.queue.peek(now)
                if seq is None:
                    break
                if self.long_rope_from is not None:
                    seq.rope_long = seq.num_tokens > self.long_rope_from
                hits = bm.lookup_prefix(seq)
                to_compute = seq.num_tokens - hits.num_blocks * bm.block_size
                if lane.admit_whole and to_compute > lane_left and lane_used > 0:
                    break  # admitted whole next step rather than split across steps
                n = bm.allocate(seq, hits, min(to_compute, lane_left))
                if n == 0:
                    admission_open = False  # out of blocks: later prompts wait too (no overtaking)
                    break
                lane.queue.remove(seq)
                seq.mark_admitted()
                self.running.append(seq)
                batch.entries.append((seq, n))
                lane_left -= n
                lane_used += n
            remaining -= lane_used
        batch.num_prefill_tokens = prefill_budget - remaining
        if stalled and batch.is_empty and self.running:
            # Every running sequence is a prefill waiting for window blocks: the newest makes room.
            victim = self.running[-1]
            self._preempt(victim)
            batch.preempted.append(victim)
        return batch

    def _schedule_decodes(self, batch: ScheduledBatch) -> None:
        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING or seq.is_prefilling or seq.num_tokens >= seq.max_num_tokens:
                continue  # the last check: its final token is still being sampled (async scheduling), it ends then
            if self.long_rope_from is not None and not seq.rope_long and seq.num_tokens > self.long_rope_from:
                self._preempt(seq)  # past the original context: its KV is recomputed with the long factors
                batch.preempted.append(seq)
                continue
            while not self.block_manager.append_slots(seq):
                victim = self.running[-1]  # newest; never one already scheduled (those are older than seq)
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                batch.entries.append((seq, 1))
                batch.num_decode_tokens += 1

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.reset_for_recompute()
        self.queues.add(seq)
        self.preemptions_total += 1

    # --- after the forward pass ----------------------------------------------------------------------------
    def complete_step(self, batch: ScheduledBatch) -> list[Sequence]:
        """Advance computed counts; return the sequences that reached the end of their tokens (sample now)."""
        done = []
        for seq, n in batch.entries:
            seq.num_computed_tokens += n
            if seq.num_computed_tokens > seq.num_tokens:
                raise KVCacheError(f"{seq.request_id}: computed {seq.num_computed_tokens} of {seq.num_tokens} tokens")
            self.block_manager.mark_computed(seq)
            if seq.num_computed_tokens == seq.num_tokens:
                done.append(seq)
        return done
