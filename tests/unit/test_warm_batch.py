"""The start-up warm-up burst (warm_batch.py): it runs a burst's batch shapes and leaves the engine as it was."""
from __future__ import annotations

from engine_fakes import expected_greedy, fake_engine

from metronome.server.engine.sampling import SamplingParams
from metronome.server.engine.warm_batch import OUTPUT_TOKENS, run_warm_batch, warm_batch_size


def test_batch_size_is_every_slot_within_half_the_cache():
    assert warm_batch_size(max_num_seqs=256, num_blocks=10_000, block_size=16) == 256
    assert warm_batch_size(max_num_seqs=256, num_blocks=100, block_size=16) == 50
    assert warm_batch_size(max_num_seqs=256, num_blocks=1, block_size=16) == 0


def test_no_burst_when_a_prompt_would_fill_a_block_the_prefix_cache_keeps():
    assert warm_batch_size(max_num_seqs=256, num_blocks=10_000, block_size=8) == 0


def test_burst_leaves_the_engine_clean_and_serving_unchanged():
    engine = fake_engine(num_kv_blocks=64, block_size=16, chunk_size=32, queue_policy="fcfs", max_num_seqs=24)
    sequences, steps, _ = run_warm_batch(engine)
    assert sequences == 24
    # 24 prompts of 8 tokens under a 32-token budget take several prefill steps, then the decode steps
    assert steps >= 24 * 8 // 32 + OUTPUT_TOKENS - 1
    stats = engine.stats()
    assert (stats.num_running, sum(stats.num_waiting.values())) == (0, 0)
    assert stats.kv_blocks_free == stats.kv_blocks_total and stats.kv_blocks_leaked == 0
    assert stats.preemptions_total == 0
    assert not engine.has_unfinished()
    prompt = [5, 9, 2, 7]
    [result] = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0))
    assert result.token_ids == expected_greedy(prompt, 6)
    engine.check_no_leaks()


def test_preemptions_of_the_burst_are_not_counted_as_serving():
    # 8 blocks for 4 sequences: the burst may preempt; whatever it does, serving's counter starts at 0
    engine = fake_engine(num_kv_blocks=8, block_size=16, chunk_size=64, max_num_seqs=8)
    sequences, _, _ = run_warm_batch(engine)
    assert sequences == 4
    assert engine.stats().preemptions_total == 0
    assert engine.stats().kv_blocks_free == 8
