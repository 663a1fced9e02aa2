"""A start-up burst through the engine's own step path, so that the first real burst is not the first of its kind.

Kernel warm-up (ModelRunner.warm_up) and graph capture compile every kernel, yet on the H200 the first time a fresh
server admitted ~64 new sequences at once one step took 133-187 ms (every 8B isolation run of 2026-12-01, with no
kernel compile and the garbage collector ruled out; docs/perf/isolation.md): whatever a batch of that shape touches
for the first time (allocator segments for its logits, the sampler's paths, first-use Python code) is paid by the
clients of that burst. Running the same shapes once before the server is ready moves that cost into start-up.

The burst: up to `max_num_seqs` prompts of a few tokens (within one KV block, so nothing enters the prefix cache),
two output tokens each (a prefill step and a decode step per shape), half greedy and half sampled, stepped to the
end. It leaves the engine as it found it: no sequence, every KV block free, no preemption counted.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from metronome.server.engine.sampling import SamplingParams

if TYPE_CHECKING:
    from metronome.server.engine.engine import EngineCore

PROMPT_TOKENS = 8
OUTPUT_TOKENS = 2
MAX_STEPS = 10_000  # a bound on a loop that must end: every request finishes after OUTPUT_TOKENS tokens


def warm_batch_size(max_num_seqs: int, num_blocks: int, block_size: int) -> int:
    """Sequences in the warm-up burst: every running slot, as far as one KV block each leaves half the cache free."""
    if block_size <= PROMPT_TOKENS + OUTPUT_TOKENS:
        return 0  # a prompt would fill a block, which prefix caching would keep: no warm-up rather than a dirty cache
    return max(0, min(max_num_seqs, num_blocks // 2))


def run_warm_batch(core: EngineCore) -> tuple[int, int, float]:
    """Run the burst on `core`; returns (sequences, steps, seconds). Raises RuntimeError if the engine is not left
    clean (a bug, not a load condition: start-up must fail rather than serve with leaked blocks)."""
    bm = core.block_manager
    count = warm_batch_size(core.scheduler.config.max_num_seqs, bm.num_blocks, bm.block_size)
    if count == 0:
        return 0, 0, 0.0
    started = time.perf_counter()
    greedy = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=1.0, top_p=0.95, seed=0, ignore_eos=True)
    prompt = [i % core.vocab_size for i in range(1, PROMPT_TOKENS + 1)]
    preemptions = core.scheduler.preemptions_total
    for i in range(count):
        core.add_prepared(list(prompt), greedy if i % 2 == 0 else sampled, f"warm-batch-{i}")
    steps = 0
    while core.has_unfinished():
        if steps >= MAX_STEPS:
            raise RuntimeError(f"the start-up warm-up burst did not finish in {MAX_STEPS} steps")
        core.step()
        steps += 1
    if core.take_failures():
        raise RuntimeError("the start-up warm-up burst failed to emit tokens")
    stats = core.stats()
    if stats.kv_blocks_free != stats.kv_blocks_total or stats.num_running or sum(stats.num_waiting.values()):
        raise RuntimeError(f"the start-up warm-up burst left the engine dirty: {stats.kv_blocks_free} of "
                           f"{stats.kv_blocks_total} KV blocks free, {stats.num_running} running")
    core.scheduler.preemptions_total = preemptions  # the burst's own, if any, are not serving's
    return count, steps, time.perf_counter() - started
