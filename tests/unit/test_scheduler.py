"""Scheduler decisions without a model: stall-free budgets, policies, preemption and live reconfiguration."""
from __future__ import annotations

import itertools

from metronome.contract.config import SchedulerConfig
from metronome.server.engine.block_manager import BlockManager
from metronome.server.engine.sampling import SamplingParams
from metronome.server.engine.scheduler import ScheduledBatch, Scheduler
from metronome.server.engine.sequence import Sequence, SequenceStatus


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Harness:
    """A scheduler plus a stand-in for the model: every sequence that finishes its tokens gets one more."""

    def __init__(self, num_blocks: int = 4096, block_size: int = 16, max_new: int = 1000, **cfg):
        self.clock = FakeClock()
        self.bm = BlockManager(num_blocks, block_size, watermark=0.01)
        self.sched = Scheduler(SchedulerConfig(**cfg), self.bm, clock=self.clock)
        self.order = itertools.count()
        self.max_new = max_new
        self.first_token_step: dict[str, int] = {}
        self.finished: list[Sequence] = []
        self.steps: list[ScheduledBatch] = []

    def add(self, name: str, prompt_len: int, max_new: int | None = None) -> Sequence:
        order = next(self.order)  # distinct prompts: no accidental prefix-cache hits
        seq = Sequence(name, [(7 * i + 13 * order) % 97 for i in range(prompt_len)], SamplingParams(),
                       arrival_time=self.clock.now, order=order)
        seq.params = SamplingParams(max_tokens=max_new or self.max_new)
        self.sched.add(seq)
        return seq

    def step(self) -> ScheduledBatch:
        batch = self.sched.schedule()
        self.steps.append(batch)
        for seq in self.sched.complete_step(batch):
            seq.token_ids.append(1)
            self.first_token_step.setdefault(seq.request_id, len(self.steps))
            if seq.num_output_tokens >= seq.params.max_tokens:
                self.sched.remove(seq)
                seq.status = SequenceStatus.FINISHED
                self.finished.append(seq)
        self.clock.now += 0.01
        self.bm.check_no_leaks(self.sched.live_sequences())
        return batch

    def has_work(self) -> bool:
        return bool(self.sched.running) or self.sched.num_waiting > 0

    def run_until_idle(self, limit: int = 10_000) -> None:
        for _ in range(limit):
            if not self.has_work():
                return
            self.step()
        raise AssertionError("scheduler did not drain")


def decode_seqs(batch: ScheduledBatch) -> set[str]:
    return {s.request_id for s, n in batch.entries if n == 1 and not _was_prefill(s, n)}


def _was_prefill(seq: Sequence, n: int) -> bool:
    return seq.num_computed_tokens - n < seq.prefill_target


def test_long_prompt_never_stalls_running_decodes_and_respects_budget():
    h = Harness(chunk_size=256, queue_policy="fcfs", max_new=200)
    decoders = [h.add(f"d{i}", 20 + i) for i in range(8)]
    while any(s.num_output_tokens == 0 for s in decoders):
        h.step()
    long = h.add("long", 2000, max_new=4)
    steps_with_long_prefill = 0
    while long.num_output_tokens == 0:
        batch = h.step()
        assert decode_seqs(batch) == {s.request_id for s in decoders}  # all 8 decodes, every step
        assert batch.num_decode_tokens == 8
        assert batch.num_prefill_tokens <= 256 and batch.num_tokens <= 8 + 256
        steps_with_long_prefill += 1
    assert steps_with_long_prefill == -(-2000 // 256)  # the budget is used fully: 8 chunks
    h.run_until_idle()
    assert len(h.finished) == 9


def test_token_cap_limits_prefill_but_not_decodes():
    h = Harness(chunk_size=512, max_num_seqs=4, max_num_batched_tokens=100, queue_policy="fcfs", max_new=50)
    for i in range(4):
        h.add(f"d{i}", 10)
    h.step()
    for _ in range(5):
        h.step()
    extra = h.add("p", 1000)
    assert extra.status is SequenceStatus.WAITING  # max_num_seqs = 4 keeps it waiting
    batch = h.step()
    assert batch.num_decode_tokens == 4 and batch.num_tokens <= 100
    h.run_until_idle()
    assert max(b.num_tokens for b in h.steps) <= 100


def test_fcfs_admits_in_arrival_order_and_chunks_partials_first():
    h = Harness(chunk_size=100, queue_policy="fcfs", max_new=1)
    h.add("a", 150)
    h.add("b", 30)
    h.add("c", 30)
    first = h.step()
    assert [(s.request_id, n) for s, n in first.entries] == [("a", 100)]
    second = h.step()
    assert [(s.request_id, n) for s, n in second.entries] == [("a", 50), ("b", 30), ("c", 20)]
    h.run_until_idle()
    assert [s.request_id for s in h.finished] == ["a", "b", "c"]


def test_split_short_prompts_behind_a_long_one_get_first_token_before_it_finishes_prefill():
    h = Harness(queue_policy="split", short_prompt_threshold=64, short_chunk_size=128, long_chunk_size=100,
                max_new=3)
    long = h.add("long", 2000)
    h.step()
    shorts = [h.add(f"s{i}", 40) for i in range(5)]
    h.run_until_idle()
    long_first = h.first_token_step["long"]
    for s in shorts:
        assert h.first_token_step[s.request_id] < long_first
    for batch in h.steps:
        long_tokens = sum(n for s, n in batch.entries if s is long)
        short_prefill = sum(n for s, n in batch.entries if s.lane == "short" and n > 1)
        assert long_tokens <= 100 and short_prefill <= 128
    # short prompts are admitted whole: each one's prefill is a single step
    for s in shorts:
        chunks = [n for batch in h.steps for seq, n in batch.entries if seq is s and n > 1]
        assert chunks == [40]


def test_split_short_prompt_larger_than_short_chunk_still_progresses():
    h = Harness(queue_policy="split", short_prompt_threshold=512, short_chunk_size=64, long_chunk_size=64, max_new=1)
    h.add("s", 300)
    h.run_until_idle()
    assert [s.request_id for s in h.finished] == ["s"]


def test_sjf_prefers_short_prompts_and_aging_prevents_starvation():
    h = Harness(queue_policy="sjf", chunk_size=64, max_num_seqs=1, sjf_aging_seconds=1.0, max_new=1)
    h.add("blocker", 10)
    h.step()
    h.add("old-long", 60)
    h.clock.now += 0.5
    h.add("young-short", 40)
    # old-long: 60 * (1 - 0.51/1) ~ 29 < young-short 40 * (1 - 0.0) -> aging lets the old long prompt go first
    h.run_until_idle()
    assert [s.request_id for s in h.finished][1:] == ["old-long", "young-short"]
    h2 = Harness(queue_policy="sjf", chunk_size=64, max_num_seqs=1, sjf_aging_seconds=100.0, max_new=1)
    h2.add("blocker", 10)
    h2.step()
    for name, n in (("p50", 50), ("p20", 20), ("p35", 35), ("p20b", 20)):
        h2.add(name, n)
    h2.run_until_idle()
    assert [s.request_id for s in h2.finished] == ["blocker", "p20", "p20b", "p35", "p50"]


def test_max_num_seqs_bounds_running():
    h = Harness(chunk_size=1000, max_num_seqs=3, queue_policy="fcfs", max_new=5)
    for i in range(7):
        h.add(f"r{i}", 10)
    while h.has_work():
        h.step()
        assert len(h.sched.running) <= 3
    assert len(h.finished) == 7


def test_preemption_recomputes_newest_first_and_everything_finishes():
    h = Harness(num_blocks=12, block_size=4, chunk_size=64, queue_policy="fcfs", max_new=12)
    seqs = [h.add(f"r{i}", 6) for i in range(4)]
    preempted: list[str] = []
    while h.has_work():
        admitted = list(h.sched.running)  # admission order: the last one is the newest
        batch = h.step()
        for victim in batch.preempted:
            preempted.append(victim.request_id)
            newer = [s for s in h.sched.running if s in admitted and admitted.index(s) > admitted.index(victim)]
            assert not newer  # the newest running sequence is the victim
    assert preempted
    assert sorted(s.request_id for s in h.finished) == [s.request_id for s in seqs]
    assert all(s.num_output_tokens == 12 for s in seqs)
    assert h.sched.preemptions_total == len(preempted)
    h.bm.check_no_leaks([])


def test_reconfigure_keeps_waiting_order_and_running_work():
    h = Harness(chunk_size=32, queue_policy="fcfs", max_num_seqs=2, max_new=4)
    h.add("a", 100)
    h.add("b", 10)
    h.step()  # "a" takes the whole chunk; "b" still waits
    waiting = [h.add(name, n) for name, n in (("c", 700), ("d", 20), ("e", 900), ("f", 30))]
    h.sched.reconfigure(SchedulerConfig(queue_policy="split", short_prompt_threshold=64, short_chunk_size=64,
                                        long_chunk_size=48, max_num_seqs=4))
    assert h.sched.waiting_counts() == {"short": 3, "long": 2}
    assert [s.request_id for s in h.sched.queues.in_arrival_order()] == ["b", "c", "d", "e", "f"]
    batch = h.step()
    assert sum(n for s, n in batch.entries if s.lane == "long" and n > 1) <= 48
    h.sched.reconfigure(SchedulerConfig(queue_policy="fcfs", chunk_size=7, max_num_seqs=8))
    for _ in range(3):
        batch = h.step()
        assert batch.num_prefill_tokens <= 7
    h.run_until_idle()
    assert sorted(s.request_id for s in h.finished) == ["a", "b", "c", "d", "e", "f"]
    assert all(s.num_output_tokens == 4 for s in waiting)
