"""The CUDA-graph decode path on the CPU: padded static buffers, recorded instead of captured.

`capture_recorded` replays by calling the forward again on the same static buffers, so everything but the graph
itself runs here: padding to a captured size (dummy decodes: slot -1, seq_len 1, the scratch block), full-width
block tables filled only as far as needed, sample rows, metadata kept per graph, the split-class choice and the
fall-back to eager for batches no graph fits. Outputs must equal the eager path's exactly.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch
from engine_fakes import attach_recorded_graphs, expected_greedy, fake_engine

from metronome.contract.config import SchedulerConfig
from metronome.server.engine.config import EngineConfig
from metronome.server.engine.cuda_graphs import (
    CAPTURE_SIZES,
    GraphRunner,
    SplitClasses,
    StaticBatch,
    capture_recorded,
    capture_sizes,
    single_class,
)
from metronome.server.engine.engine import EngineCore
from metronome.server.engine.sampling import SamplingParams


def run_to_completion(engine: EngineCore, prompts: list[list[int]], max_tokens: list[int]):
    """Step by hand (so the step stats are seen); returns {request id: tokens} and [(num_seqs, used a graph)]."""
    ids = [engine.add_request(p, SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True))
           for p, m in zip(prompts, max_tokens)]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    steps = []
    while engine.has_unfinished():
        events, stats = engine.step()
        steps.append((stats.num_seqs, stats.cuda_graph, stats.num_prefill_tokens))
        for event in events:
            if event.token_id >= 0:
                tokens[event.request_id].append(event.token_id)
    return [tokens[rid] for rid in ids], steps


def test_capture_sizes_cover_the_batch_limit():
    assert capture_sizes(1) == [1]
    assert capture_sizes(64)[-1] == 64 and capture_sizes(100)[-2:] == [96, 100]
    assert capture_sizes(256) == [s for s in CAPTURE_SIZES if s <= 256]
    assert capture_sizes(10_000) == list(CAPTURE_SIZES)  # beyond the largest size, steps run eager
    assert capture_sizes(0) == []


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_padded_graph_decode_is_exact_on_the_context_sum_model(block_size):
    engine = fake_engine(block_size=block_size, num_kv_blocks=8192 // block_size, chunk_size=64, queue_policy="fcfs")
    graphs = attach_recorded_graphs(engine, [1, 2, 4, 8, 16])
    rng = random.Random(block_size)
    # 11 sequences with staggered lengths: the decode batch shrinks 11 -> 1 through sizes that need padding, and
    # block tables of different widths (prompts of 1 .. 70 tokens) share a batch.
    prompts = [[rng.randrange(0, 126) for _ in range(rng.randint(1, 70))] for _ in range(11)]
    max_tokens = [3 + 2 * i for i in range(11)]
    outputs, steps = run_to_completion(engine, prompts, max_tokens)
    assert outputs == [expected_greedy(p, m) for p, m in zip(prompts, max_tokens)]
    graph_batches = {n for n, used, _ in steps if used}
    assert graph_batches - set(graphs.sizes), "no step needed padding"
    assert all(used for n, used, prefill in steps if not prefill)  # every decode-only step replayed a graph
    engine.check_no_leaks()


def test_batches_larger_than_every_graph_run_eager_and_stay_exact():
    engine = fake_engine(block_size=4, chunk_size=256)
    attach_recorded_graphs(engine, [1, 2, 4])
    rng = random.Random(7)
    prompts = [[rng.randrange(0, 126) for _ in range(rng.randint(5, 30))] for _ in range(6)]
    outputs, steps = run_to_completion(engine, prompts, [6] * 6)
    assert outputs == [expected_greedy(p, 6) for p in prompts]
    assert not any(used for n, used, _ in steps if n > 4)
    assert not any(used for _, used, prefill in steps if prefill)  # mixed steps are never replayed


def test_random_tiny_graph_decode_equals_eager_greedy():
    def engine() -> EngineCore:
        config = EngineConfig(model="random:tiny", device="cpu", dtype="float32", attention_backend="torch",
                              block_size=16, num_kv_blocks=256, seed=5)
        return EngineCore.from_config(config, SchedulerConfig(chunk_size=64, max_num_seqs=16))

    rng = random.Random(3)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(1, 90))] for _ in range(7)]
    max_tokens = [4 + 3 * i for i in range(7)]
    eager, eager_steps = run_to_completion(engine(), prompts, max_tokens)
    graphed_engine = engine()
    attach_recorded_graphs(graphed_engine, [2, 8])
    graphed, steps = run_to_completion(graphed_engine, prompts, max_tokens)
    assert graphed == eager
    assert not any(used for _, used, _ in eager_steps) and any(used for _, used, _ in steps)


def test_static_batch_pads_with_dummy_decodes_on_the_scratch_block():
    static = StaticBatch(size=4, cols=5, scratch_block=99, device=torch.device("cpu"))
    tables = np.array([[3, 7], [4, 8]], dtype=np.int32)
    rows = static.fill(np.array([11, 12]), np.array([20, 25]), np.array([56, 130]), np.array([21, 26]), tables,
                       np.array([1]))
    assert static.input_ids.tolist() == [11, 12, 0, 0] and static.positions.tolist() == [20, 25, 0, 0]
    assert static.slot_mapping.tolist() == [56, 130, -1, -1]  # padding rows never write the cache
    assert static.seq_lens.tolist() == [21, 26, 1, 1] and static.cu_seqlens_q.tolist() == [0, 1, 2, 3, 4]
    assert static.block_tables[:2, :2].tolist() == [[3, 7], [4, 8]]
    assert static.block_tables[2:].tolist() == [[99] * 5, [99] * 5]
    assert rows.tolist() == [1]
    # A later, smaller batch: its rows are rewritten, the rest becomes padding again.
    static.fill(np.array([5]), np.array([2]), np.array([9]), np.array([3]), np.array([[6]], dtype=np.int32),
                np.array([0]))
    assert static.slot_mapping.tolist() == [9, -1, -1, -1] and static.block_tables[1].tolist() == [99] * 5
    meta = static.metadata(max_seqlen_k=300)
    assert meta.q_lens_host == [1] * 4 and meta.block_tables.shape == (4, 5) and meta.is_decode_only


def test_each_step_replays_the_graph_of_its_split_class():
    """A size is captured once per split class; a step picks the class its longest context gives."""
    calls = []

    def forward(input_ids, positions, meta):
        calls.append(meta.max_seqlen_k)
        return input_ids.to(torch.float32)[:, None] * 2

    classes = SplitClasses(lambda size, max_k: 1 if max_k < 1024 else 4, max_model_len=2048, lengths=(1, 1024, 2048))
    graphs = GraphRunner(forward, [2], 3, 0, torch.device("cpu"), classes, capture_recorded)
    report = graphs.capture_all()
    assert report.graphs == 2 and sorted(graphs.graphs) == [(2, 1), (2, 4)]
    step, _ = graphs.prepare(np.array([7]), np.array([1]), np.array([1]), np.array([1500]),
                             np.zeros((1, 1), dtype=np.int32), np.array([0]))
    assert step.graph is graphs.graphs[(2, 4)] and step.graph.meta.max_seqlen_k == 2048
    assert GraphRunner.run(step)[:1, 0].tolist() == [14.0]
    short, _ = graphs.prepare(np.array([7]), np.array([1]), np.array([1]), np.array([10]),
                              np.zeros((1, 1), dtype=np.int32), np.array([0]))
    assert short.graph is graphs.graphs[(2, 1)]
    assert graphs.prepare(np.arange(3), np.arange(3), np.arange(3), np.ones(3, dtype=np.int64),
                          np.zeros((3, 1), dtype=np.int32), np.arange(3)) is None  # larger than every size


def test_split_classes_match_the_triton_choice_for_every_context_length():
    from metronome.kernels.triton_attention import choose_num_splits
    from metronome.kernels.triton_backend import TritonBackend

    n_kv, sms, max_len = 8, 132, 8192
    lengths = tuple(TritonBackend().variant_lengths(max_len))  # the backend names where its variants change
    classes = SplitClasses(lambda size, k: choose_num_splits(size * n_kv, size, k, sms), max_len, lengths)
    for size in capture_sizes(256):
        reps = classes.representatives(size)
        assert all(classes.of(size, k) == c for c, k in reps.items())
        for k in range(1, max_len + 1, 37):
            assert classes.of(size, k) in reps
    assert len(classes.representatives(1)) > 1 and len(classes.representatives(256)) == 1


def test_backends_without_host_decisions_have_one_decode_variant():
    from metronome.kernels import get_backend
    from metronome.server.engine.cuda_graphs import backend_split_classes

    classes = backend_split_classes(get_backend("torch"), 8, torch.device("cpu"), 4096)
    assert classes.representatives(64) == {0: 4096}


def test_a_graph_that_disagrees_with_eager_is_rejected():
    def broken_capture(fn, pool):
        output = fn()
        return lambda: output.add_(1.0), output  # replays something else

    graphs = GraphRunner(lambda ids, pos, meta: ids.to(torch.float32)[:, None], [1], 2, 0, torch.device("cpu"),
                         single_class(64), broken_capture)
    with pytest.raises(RuntimeError, match="disagrees with eager"):
        graphs.capture_all()


def test_engine_reports_its_execution_mode():
    engine = fake_engine()
    assert engine.stats().execution_mode == "eager: not on CUDA"
    from engine_fakes import fake_loaded

    off = EngineCore(fake_loaded(), EngineConfig(model="fake", device="cpu", num_kv_blocks=64, cuda_graphs=False),
                     SchedulerConfig())
    assert off.stats().execution_mode.startswith("eager: cuda_graphs disabled")


def _triton_tiny_engine() -> EngineCore:
    config = EngineConfig(model="random:tiny", device="cpu", dtype="float32", attention_backend="triton",
                          block_size=16, num_kv_blocks=128, seed=5)
    return EngineCore.from_config(config, SchedulerConfig(chunk_size=64, max_num_seqs=16))


def _triton_frozen_host_facts_run() -> dict:
    """Subprocess entry (TRITON_INTERPRET=1): eager Triton vs recorded graphs whose metadata keeps the host facts of
    capture time (refresh_host_facts=False), as a real CUDA graph does: the padded static buffers alone must carry
    each step's batch to the kernels."""
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(1, 40))] for _ in range(4)]
    max_tokens = [2 + i for i in range(4)]
    eager, _ = run_to_completion(_triton_tiny_engine(), prompts, max_tokens)
    engine = _triton_tiny_engine()
    runner = engine.runner
    graphs = GraphRunner(runner.graph_forward, [2, 8], runner.mirror.cols, runner.scratch_block, runner.device,
                         single_class(engine.max_model_len), capture_recorded, refresh_host_facts=False)
    graphs.capture_all()
    runner.attach_graphs(graphs)
    graphed, steps = run_to_completion(engine, prompts, max_tokens)
    return {"eager": eager, "graphed": graphed, "graph_steps": sum(used for _, used, _ in steps)}


def test_triton_decode_through_static_buffers_needs_no_fresh_host_facts():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600,
                          cwd=os.path.dirname(__file__))
    assert proc.returncode == 0, f"triton interpreter run failed:\n{proc.stdout}\n{proc.stderr}"
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["graph_steps"] > 0
    assert result["graphed"] == result["eager"]


if __name__ == "__main__":
    print(json.dumps(_triton_frozen_host_facts_run()))
