"""Sliding-window KV groups: the layout of layers into equal groups, window blocks freed behind the window (a
window group's cache stays bounded however long the sequence), full groups keeping every block, prefix hits cut
back to what every group can still serve, and a hypothesis run of admit / compute / decode / preempt / finish
whose leak check and window bound hold after every step."""
from __future__ import annotations

import itertools

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from metronome.server.engine.block_manager import FREED, BlockManager
from metronome.server.engine.kv_layout import kv_layout
from metronome.server.engine.sampling import SamplingParams
from metronome.server.engine.sequence import Sequence

_ids = itertools.count()
BS, WINDOW = 4, 10


def make_seq(tokens: list[int]) -> Sequence:
    n = next(_ids)
    return Sequence(f"w{n}", tokens, SamplingParams(), arrival_time=0.0, order=n)


def test_layout_groups_layers_by_window_in_equal_groups():
    gemma_12b = kv_layout(((1024,) * 5 + (None,)) * 8)  # 48 layers, 5 local : 1 global
    assert gemma_12b.group_windows == (None,) + (1024,) * 5 and gemma_12b.group_size == 8
    assert [gemma_12b.layer_group[i] for i in (5, 11, 47)] == [0, 0, 0]
    assert gemma_12b.layer_group[0] == 1 and gemma_12b.layer_slot[:5] == (0, 1, 2, 3, 4)
    gemma_1b = kv_layout(((512,) * 5 + (None,)) * 4 + (512, 512))  # 26 layers: 4 global, 22 local
    assert gemma_1b.group_size == 2 and gemma_1b.group_windows.count(None) == 2 and gemma_1b.num_groups == 13
    plain = kv_layout((None,) * 4)
    assert plain.group_windows == (None,) and plain.layer_slot == (0, 1, 2, 3)
    mistral = kv_layout((4096,) * 32)
    assert mistral.group_windows == (4096,) and mistral.group_size == 32
    for layout in (gemma_12b, gemma_1b):  # every (group, slot) names exactly one layer
        pairs = list(zip(layout.layer_group, layout.layer_slot))
        assert len(set(pairs)) == len(pairs)


def run_prefill(bm: BlockManager, seq: Sequence, chunk: int) -> None:
    """Admit and compute seq's prompt in chunks, as the scheduler does."""
    hit = bm.lookup_prefix(seq)
    n = bm.allocate(seq, hit, chunk)
    assert n > 0
    seq.mark_admitted()
    while True:
        seq.num_computed_tokens += n
        bm.mark_computed(seq)
        if seq.num_computed_tokens == seq.num_tokens:
            return
        n = bm.reserve(seq, min(chunk, seq.num_uncomputed_tokens))
        assert n > 0


def live(table: list[int]) -> int:
    return sum(b != FREED for b in table)


def test_window_groups_free_blocks_behind_the_window_and_stay_bounded():
    bm = BlockManager(num_blocks=64, block_size=BS, watermark=0, group_windows=(None, WINDOW, WINDOW))
    seq = make_seq(list(range(100)))
    run_prefill(bm, seq, chunk=7)
    full, local = seq.block_tables[0], seq.block_tables[1]
    assert live(full) == 25  # every token of the full group
    bound = -(-(WINDOW - 1 + 7) // BS) + 1  # a window and a chunk
    assert live(local) <= bound and local[0] == FREED
    for _ in range(60):  # decodes: the full group grows, the window groups do not
        seq.token_ids.append(7)
        assert bm.append_slots(seq)
        assert all(live(t) <= -(-WINDOW // BS) + 1 for t in seq.block_tables[1:])
        seq.num_computed_tokens += 1
        bm.mark_computed(seq)
    assert live(seq.block_tables[0]) == 40
    # The live window blocks cover every position the next query sees.
    c = seq.num_computed_tokens
    for position in range(c - WINDOW + 1, c):
        assert seq.block_tables[1][position // BS] != FREED
    bm.check_no_leaks([seq])
    bm.free(seq)
    assert bm.num_free_blocks == 64


def test_a_window_only_model_holds_a_window_whatever_the_context():
    bm = BlockManager(num_blocks=12, block_size=BS, watermark=0, group_windows=(WINDOW,))
    assert bm.max_admissible_tokens() > 10_000  # the context limit is the model's, not the cache's
    seq = make_seq(list(range(200)))  # 50 blocks of context in a 12-block cache
    run_prefill(bm, seq, chunk=8)
    assert live(seq.block_table) <= 5
    bm.check_no_leaks([seq])


def test_prefix_hit_needs_only_the_window_blocks_and_is_cut_back_when_they_are_gone():
    bm = BlockManager(num_blocks=80, block_size=BS, watermark=0, group_windows=(None, WINDOW))
    prompt = list(range(40))
    first = make_seq(prompt + [99])
    run_prefill(bm, first, chunk=5)
    bm.free(first)  # every block cached: the full group's 10, the window group's last few
    again = make_seq(prompt + [98])
    hit = bm.lookup_prefix(again)
    assert hit.num_blocks == 10  # the window group still holds the blocks position 40 can see
    assert live(hit.tables[1]) == len(range((40 - WINDOW + 1) // BS, 10))
    # Evict the window group's cached blocks that position 40 would read: the hit must stop before them.
    needed = [b for b in hit.tables[1] if b != FREED]
    for block in needed[-1:]:
        key = bm._block_hash[block]
        del bm._cached[key]
        bm._block_hash[block] = bm._block_key[block] = None
    cut = bm.lookup_prefix(again)
    assert cut.num_blocks < 10
    for i in range(max(0, cut.num_blocks * BS - WINDOW + 1) // BS, cut.num_blocks):
        assert cut.tables[1][i] != FREED  # what the first token to compute sees is all there
    n = bm.allocate(again, cut, 8)
    assert n == min(8, again.num_tokens - cut.num_blocks * BS) and again.num_computed_tokens == cut.num_blocks * BS
    bm.check_no_leaks([again])


def test_prefill_short_of_window_blocks_gets_fewer_tokens_not_an_error():
    bm = BlockManager(num_blocks=9, block_size=BS, watermark=0, group_windows=(None, WINDOW))
    seq = make_seq(list(range(24)))  # 6 full blocks
    hit = bm.lookup_prefix(seq)
    granted = bm.allocate(seq, hit, 24)
    assert 0 < granted < 24  # the window group has 3 free blocks for the first step
    assert live(seq.block_tables[1]) == 3
    bm.check_no_leaks([seq])


class WindowMachine(RuleBasedStateMachine):
    """Random admissions, chunked prefills, decodes, preemptions and finishes over a full group and two window
    groups: no leak, and no window group ever holds more than a window and a step's worth of blocks."""

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(num_blocks=60, block_size=BS, watermark=0.05, group_windows=(None, WINDOW, 6))
        self.running: list[Sequence] = []
        self.chunk = 6

    @rule(length=st.integers(1, 40), shared=st.booleans())
    def admit(self, length, shared):
        tokens = list(range(length)) if shared else [next(_ids) % 50 + 100 for _ in range(length)]
        seq = make_seq(tokens)
        hit = self.bm.lookup_prefix(seq)
        n = self.bm.allocate(seq, hit, min(self.chunk, seq.num_tokens - hit.num_blocks * BS))
        if n:
            seq.mark_admitted()
            seq.num_computed_tokens += n
            self.bm.mark_computed(seq)
            self.running.append(seq)

    @rule(index=st.integers(0, 20))
    def step(self, index):
        if not self.running:
            return
        seq = self.running[index % len(self.running)]
        if seq.num_computed_tokens < seq.num_tokens:
            n = self.bm.reserve(seq, min(self.chunk, seq.num_uncomputed_tokens))
        else:
            seq.token_ids.append(5)
            n = 1 if self.bm.append_slots(seq) else 0
            if not n:
                seq.token_ids.pop()
        seq.num_computed_tokens += n
        self.bm.mark_computed(seq)

    @rule(index=st.integers(0, 20))
    def finish(self, index):
        if self.running:
            seq = self.running.pop(index % len(self.running))
            self.bm.free(seq)

    @invariant()
    def consistent(self):
        self.bm.check_no_leaks(self.running)
        for seq in self.running:
            for g in self.bm.window_groups:
                table = seq.block_tables[g]
                window = self.bm.windows[g]
                assert live(table) <= -(-(window - 1 + self.chunk) // BS) + 1
                c = seq.num_computed_tokens
                for position in range(max(0, c - window + 1), c):  # what the next query sees is there
                    assert table[position // BS] != FREED


TestWindowMachine = WindowMachine.TestCase
TestWindowMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


@pytest.mark.parametrize("windows", [(None,), (None, WINDOW)])
def test_max_admissible_tokens_counts_full_groups_and_window_reserves(windows):
    bm = BlockManager(num_blocks=100, block_size=BS, watermark=0, group_windows=windows)
    reserve = sum(bm.window_reserve(g) for g in bm.window_groups)
    assert bm.max_admissible_tokens() == (100 - reserve) * BS


def test_blocks_held_counts_every_token_in_full_groups_and_a_window_in_window_groups():
    bm = BlockManager(num_blocks=200, block_size=BS, watermark=0, group_windows=(None, WINDOW, WINDOW))
    assert bm.blocks_held(8) == 2 * 3  # shorter than the window: every group holds all of it
    assert bm.blocks_held(400) == 100 + 2 * (-(-(WINDOW - 1 + 1) // BS) + 1)
    assert bm.blocks_held(400, step_tokens=20) == 100 + 2 * (-(-(WINDOW - 1 + 20) // BS) + 1)
    seq = make_seq(list(range(400)))
    run_prefill(bm, seq, chunk=20)
    assert sum(live(t) for t in seq.block_tables) <= bm.blocks_held(400, 20)
