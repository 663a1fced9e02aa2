"""Piecewise graphs for mixed steps on the CPU: the pieces recorded instead of captured.

`capture_recorded` replays a piece by running it again on the same static buffers, so everything but the CUDA
graph itself runs here: token buckets, padding rows (token 0, position 0, slot -1), the shared q and attention
buffers, the residual handed from piece to piece, the eager attention between pieces over the step's own
metadata, and the fall-back to eager for steps larger than every bucket. Greedy outputs must equal eager's.
"""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from metronome.contract.config import SchedulerConfig
from metronome.server.engine.config import EngineConfig
from metronome.server.engine.cuda_graphs import capture_recorded
from metronome.server.engine.engine import EngineCore
from metronome.server.engine.piecewise_graphs import TOKEN_BUCKETS, StaticTokens, token_buckets
from metronome.server.engine.sampling import SamplingParams


def test_token_buckets_cover_the_limit():
    assert token_buckets(4096) == list(TOKEN_BUCKETS)
    assert token_buckets(100)[-2:] == [64, 100] and token_buckets(64)[-1] == 64
    assert token_buckets(10_000) == list(TOKEN_BUCKETS)  # larger steps run eager
    assert token_buckets(0) == []
    assert all(b - a <= 64 for a, b in zip(TOKEN_BUCKETS, TOKEN_BUCKETS[1:]) if b <= 1024)


def test_static_tokens_pad_with_skipped_slots_and_reset_stale_rows():
    static = StaticTokens(8, torch.device("cpu"))
    static.fill(np.array([5, 6, 7]), np.array([10, 11, 12]), np.array([40, 41, 42]), np.array([2]))
    assert static.input_ids.tolist() == [5, 6, 7, 0, 0, 0, 0, 0]
    assert static.slot_mapping.tolist() == [40, 41, 42, -1, -1, -1, -1, -1]
    static.fill(np.array([9]), np.array([3]), np.array([8]), np.array([0]))
    assert static.input_ids.tolist()[:3] == [9, 0, 0] and static.positions.tolist()[:3] == [3, 0, 0]
    assert static.slot_mapping.tolist()[:3] == [8, -1, -1]  # rows the last step used are padding again
    assert static.sample_rows[:1].tolist() == [0]


def _engine(chunk_size: int = 24) -> EngineCore:
    config = EngineConfig(model="random:tiny", device="cpu", dtype="float32", attention_backend="torch",
                          block_size=16, num_kv_blocks=256, seed=5)
    return EngineCore.from_config(config, SchedulerConfig(chunk_size=chunk_size, max_num_seqs=16,
                                                          queue_policy="fcfs"))


def _run(engine: EngineCore, prompts: list[list[int]], max_tokens: list[int]):
    ids = [engine.add_request(p, SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True))
           for p, m in zip(prompts, max_tokens)]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    forwards = []
    while engine.has_unfinished():
        events, stats = engine.step()
        if stats.num_tokens:
            forwards.append((stats.forward, stats.kind, stats.num_tokens))
        for event in events:
            if event.token_id >= 0:
                tokens[event.request_id].append(event.token_id)
    engine.check_no_leaks()
    return [tokens[rid] for rid in ids], forwards


def test_piecewise_mixed_steps_equal_eager_greedy():
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(1, 60))] for _ in range(7)]
    max_tokens = [3 + 2 * i for i in range(7)]
    eager, eager_forwards = _run(_engine(), prompts, max_tokens)
    assert {f for f, _, _ in eager_forwards} == {"eager"}

    engine = _engine()
    runner = engine.runner
    pieces = runner.piecewise_runner([8, 16, 32], capture_recorded)
    report = pieces.capture_all()
    assert report.graphs == 3 * runner.model.num_pieces
    runner.attach_pieces(pieces)
    graphed, forwards = _run(engine, prompts, max_tokens)
    assert graphed == eager
    used = [n for f, _, n in forwards if f == "piecewise"]
    assert used and any(n not in (8, 16, 32) for n in used), "no step needed padding"
    assert all(f == "piecewise" for f, _, n in forwards if n <= 32)  # every step that fits a bucket
    assert any(kind == "mixed" for f, kind, _ in forwards if f == "piecewise")


def test_steps_larger_than_every_bucket_run_eager():
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 512) for _ in range(40)] for _ in range(3)]
    eager, _ = _run(_engine(chunk_size=64), prompts, [4, 4, 4])
    engine = _engine(chunk_size=64)
    pieces = engine.runner.piecewise_runner([8], capture_recorded)
    pieces.capture_all()
    engine.runner.attach_pieces(pieces)
    graphed, forwards = _run(engine, prompts, [4, 4, 4])
    assert graphed == eager
    assert all(f == "eager" for f, _, n in forwards if n > 8)
    assert any(f == "piecewise" for f, _, n in forwards)


def test_piece_chain_is_the_forward():
    """The eager forward is the chain of pieces and attentions: calling them by hand gives forward's result."""
    engine = _engine()
    model, caches = engine.runner.model, engine.runner.kv_caches
    from metronome.kernels.metadata import scratch_metadata

    meta = scratch_metadata([3, 2], engine.runner.scratch_block, "cpu")
    ids = torch.tensor([5, 9, 11, 2, 7])
    positions = torch.tensor([0, 1, 2, 0, 1])
    x, residual = ids, None
    for index in range(model.num_pieces):
        out, residual = model.piece(index, x, residual, positions, meta.slot_mapping, caches)
        if residual is None:
            break
        x = model.attend(index, out, caches, meta)
    assert torch.equal(out, model.forward(ids, positions, caches, meta))


@pytest.mark.parametrize("preset", ["tiny-gemma3", "tiny-qwen3"])
def test_window_families_replay_graphs_with_a_block_table_per_kv_group(preset):
    """Recorded decode graphs and piecewise graphs of a model whose sliding layers keep their KV in groups of
    their own (one block table and slot mapping per group in the static buffers), prompts past the 48-token
    window: the same greedy output as eager."""
    from engine_fakes import attach_recorded_graphs

    def engine():
        config = EngineConfig(model=f"random:{preset}", device="cpu", dtype="float32", attention_backend="torch",
                              block_size=16, num_kv_blocks=256, seed=5)
        return EngineCore.from_config(config, SchedulerConfig(chunk_size=24, max_num_seqs=16, queue_policy="fcfs"))

    rng = random.Random(3)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 50, 70, 20)]
    max_tokens = [30, 12, 25, 18]
    eager, _ = _run(engine(), prompts, max_tokens)
    graphed_engine = engine()
    assert graphed_engine.runner.layout.num_groups > 1
    attach_recorded_graphs(graphed_engine, [2, 4])
    pieces = graphed_engine.runner.piecewise_runner([16, 32], capture_recorded)
    pieces.capture_all()
    graphed_engine.runner.attach_pieces(pieces)
    graphed, forwards = _run(graphed_engine, prompts, max_tokens)
    assert graphed == eager
    kinds = {(f, kind) for f, kind, _ in forwards}
    assert ("graph", "decode") in kinds and ("piecewise", "mixed") in kinds, kinds
