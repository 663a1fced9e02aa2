"""Paged KV bookkeeping: allocation, prefix sharing, LRU reuse of cached free blocks, leak checks, and a
hypothesis state machine over admit / extend / finish / abort / preempt."""
from __future__ import annotations

import itertools

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from metronome.server.engine.block_manager import BlockManager, KVCacheError
from metronome.server.engine.sampling import SamplingParams
from metronome.server.engine.sequence import Sequence

_ids = itertools.count()


def make_seq(tokens: list[int]) -> Sequence:
    n = next(_ids)
    return Sequence(f"r{n}", tokens, SamplingParams(), arrival_time=0.0, order=n)


def admit(bm: BlockManager, seq: Sequence) -> bool:
    ok = bm.allocate(seq, bm.lookup_prefix(seq))
    if ok:
        seq.mark_admitted()
    return ok


def compute_all(bm: BlockManager, seq: Sequence) -> None:
    seq.num_computed_tokens = seq.num_tokens
    bm.mark_computed(seq)


def test_allocate_covers_whole_prompt_and_free_returns_blocks():
    bm = BlockManager(num_blocks=10, block_size=4, watermark=0)
    seq = make_seq(list(range(10)))
    assert admit(bm, seq)
    assert len(seq.block_table) == 3 and seq.num_computed_tokens == 0
    assert bm.num_free_blocks == 7
    bm.check_no_leaks([seq])
    bm.free(seq)
    assert bm.num_free_blocks == 10
    bm.check_no_leaks([])


def test_prefix_hit_shares_full_blocks_and_never_covers_the_whole_prompt():
    bm = BlockManager(num_blocks=20, block_size=4, watermark=0)
    a = make_seq(list(range(12)))  # exactly 3 full blocks
    assert admit(bm, a)
    compute_all(bm, a)
    b = make_seq(list(range(12)))  # identical prompt: the last block must be recomputed
    assert admit(bm, b)
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] != a.block_table[2]
    assert b.num_computed_tokens == 8 and b.num_cached_tokens == 8
    assert bm.ref_counts[a.block_table[0]] == 2
    c = make_seq(list(range(6)) + [99, 98, 97])  # shares only the first block
    assert admit(bm, c)
    assert c.block_table[0] == a.block_table[0] and c.num_computed_tokens == 4
    bm.check_no_leaks([a, b, c])
    for s in (a, b, c):
        bm.free(s)
    bm.check_no_leaks([])


def test_freed_cached_blocks_stay_findable_and_lru_evicts_least_recently_freed():
    bm = BlockManager(num_blocks=4, block_size=2, watermark=0)
    a = make_seq([1, 2, 3, 4, 5])  # 2 full blocks + 1 partial
    assert admit(bm, a)
    compute_all(bm, a)
    a_full = a.block_table[:2]
    bm.free(a)
    assert bm.num_cached_blocks == 2
    again = make_seq([1, 2, 3, 4, 9])
    assert admit(bm, again)  # revives both cached blocks from the free list
    assert again.block_table[:2] == a_full and again.num_computed_tokens == 4
    bm.free(again)
    # Uncached blocks are reused before cached ones; the tail block was freed first, so it is evicted first.
    other = make_seq([7, 7, 7, 7, 7, 7])  # 3 blocks: the 2 uncached ones, then one cached block evicted
    assert admit(bm, other)
    assert a_full[1] in other.block_table  # second (tail) block evicted before the prefix block
    assert a_full[0] not in other.block_table
    bm.free(other)
    probe = make_seq([1, 2, 3, 4, 5])
    assert bm.lookup_prefix(probe) == [a_full[0]]  # the first block is still cached


def test_watermark_blocks_admission_but_not_decode_growth():
    bm = BlockManager(num_blocks=100, block_size=1, watermark=0.05)
    assert bm.watermark_blocks == 5
    big = make_seq(list(range(96)))
    assert not admit(bm, big)  # 96 > 100 - 5
    assert bm.num_free_blocks == 100 and big.block_table == []
    ok = make_seq(list(range(95)))
    assert admit(bm, ok)
    for t in range(5):  # decode growth may use the watermark
        ok.token_ids.append(1000 + t)
        assert bm.append_slots(ok)
    ok.token_ids.append(2000)
    assert not bm.can_append(ok) and not bm.append_slots(ok)
    bm.check_no_leaks([ok])


def test_leak_check_reports_blocks_nobody_owns():
    bm = BlockManager(num_blocks=8, block_size=4, watermark=0)
    seq = make_seq(list(range(9)))
    assert admit(bm, seq)
    seq_blocks = list(seq.block_table)
    assert bm.count_leaked([seq]) == 0
    assert bm.count_leaked([]) == 3  # the engine forgot the sequence without freeing it
    with pytest.raises(KVCacheError, match="refcount 1, owned by 0"):
        bm.check_no_leaks([])
    bm.free(seq)
    with pytest.raises(KVCacheError, match="freed more often"):
        bm.free(_with_table("double-free", [seq_blocks[0]]))


def _with_table(rid: str, table: list[int]) -> Sequence:
    s = Sequence(rid, [1], SamplingParams(), 0.0, 0)
    s.block_table = list(table)
    return s


def test_block_size_256_works():
    bm = BlockManager(num_blocks=8, block_size=256, watermark=0)
    a = make_seq(list(range(600)))
    assert admit(bm, a) and len(a.block_table) == 3
    compute_all(bm, a)
    b = make_seq(list(range(513)))
    assert admit(bm, b) and b.num_computed_tokens == 512


class KVMachine(RuleBasedStateMachine):
    """Random admit/extend/finish/abort/preempt sequences against the invariants."""

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(num_blocks=24, block_size=4, watermark=0.05)
        self.live: list[Sequence] = []

    prompts = st.lists(st.integers(0, 3), min_size=1, max_size=30)

    @rule(tokens=prompts, shared=st.booleans())
    def admit(self, tokens, shared):
        if shared and self.live:  # reuse a live prompt's start to provoke prefix hits
            tokens = self.live[0].token_ids[: len(tokens) + 4] + tokens[:2]
        seq = make_seq(list(tokens))
        hits = self.bm.lookup_prefix(seq)
        if admit(self.bm, seq):
            assert seq.block_table[: len(hits)] == hits  # prefix hits share blocks
            assert seq.num_computed_tokens < seq.num_tokens  # never a whole-prompt hit
            for b in hits:
                assert self.bm.ref_counts[b] >= 1
            self.live.append(seq)
        else:
            assert seq.block_table == []

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100), steps=st.integers(1, 12))
    def compute_and_extend(self, i, steps):
        seq = self.live[i % len(self.live)]
        compute_all(self.bm, seq)
        for _ in range(steps):
            seq.token_ids.append(len(seq.token_ids) % 3)
            if not self.bm.append_slots(seq):
                seq.token_ids.pop()
                break
            compute_all(self.bm, seq)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100))
    def finish_or_abort(self, i):
        seq = self.live.pop(i % len(self.live))
        self.bm.free(seq)

    @precondition(lambda self: self.live)
    @rule()
    def preempt_newest(self):
        seq = self.live.pop()
        self.bm.free(seq)
        seq.reset_for_recompute()
        if admit(self.bm, seq):  # recompute: the freed, cached blocks can come back
            self.live.append(seq)

    @invariant()
    def refcounts_consistent(self):
        assert min(self.bm.ref_counts) >= 0
        self.bm.check_no_leaks(self.live)
        assert self.bm.count_leaked(self.live) == 0

    def teardown(self):
        for seq in self.live:
            self.bm.free(seq)
        self.bm.check_no_leaks([])
        assert self.bm.num_free_blocks == self.bm.num_blocks


TestKVMachine = KVMachine.TestCase
TestKVMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
