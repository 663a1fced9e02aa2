"""A mixed step as two micro-batches (mixed_overlap.py) on the CPU: the decode graph and the chunk's piecewise
graphs recorded instead of captured, so the split itself runs here (which rows go where, each part's static
inputs and metadata, the sampled rows put back in order, tokens still in flight under async scheduling) and must
give the whole step's logits and greedy tokens. On the GPU the two parts also run on two streams
(tests/gpu/test_mixed_gpu.py)."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from engine_fakes import attach_recorded_graphs, record_logits

from metronome.contract.config import SchedulerConfig
from metronome.contract.errors import InvalidRequestError
from metronome.server.engine.config import EngineConfig
from metronome.server.engine.cuda_graphs import capture_recorded
from metronome.server.engine.engine import EngineCore
from metronome.server.engine.mixed_overlap import MixedOverlap, leading_decodes, split_point
from metronome.server.engine.sampling import SamplingParams
from metronome_testing.engine_runs import run_to_completion


def test_a_step_splits_after_its_leading_decodes_when_something_follows():
    assert split_point(np.array([1, 1, 1, 40])) == 3
    assert split_point(np.array([1, 1, 7, 1, 30])) == 2  # a decode behind a chunk rides with the chunk part
    assert split_point(np.array([1, 1, 1])) == 0  # decode-only: the decode graph runs it whole
    assert split_point(np.array([12, 1, 1])) == 0  # no leading decode: nothing to overlap
    assert split_point(np.array([9])) == 0
    assert leading_decodes(np.array([1, 1, 1])) == 3 and leading_decodes(np.array([4, 1])) == 0


def _engine(overlap: bool, async_mode: str = "off", preset: str = "random:tiny") -> EngineCore:
    config = EngineConfig(model=preset, device="cpu", dtype="float32", attention_backend="torch", block_size=16,
                          num_kv_blocks=256, seed=5, async_scheduling=async_mode)
    core = EngineCore.from_config(config, SchedulerConfig(chunk_size=24, max_num_seqs=16, queue_policy="fcfs"))
    if overlap:
        core.runner.overlap = MixedOverlap(core.runner.device)
    attach_recorded_graphs(core, [2, 4, 8, 16])
    pieces = core.runner.piecewise_runner([16, 32, 64], capture_recorded)
    pieces.capture_all()
    core.runner.attach_pieces(pieces)
    return core


def _workload(seed: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(1, 70))] for _ in range(9)]
    params = [SamplingParams(max_tokens=2 + 3 * (i % 4), temperature=0.0, ignore_eos=True) for i in range(9)]
    return prompts, params


def test_overlapped_steps_give_the_whole_steps_logits_and_greedy_tokens():
    prompts, params = _workload(7)
    whole, split = _engine(False), _engine(True)
    whole_logits, split_logits = record_logits(whole), record_logits(split)
    expected, whole_kinds = run_to_completion(whole, prompts, params)
    got, kinds = run_to_completion(split, prompts, params)
    assert got == expected
    assert "overlap" in kinds and "overlap" not in whole_kinds
    assert kinds.count("overlap") == whole_kinds.count("piecewise") - kinds.count("piecewise")
    assert len(split_logits) == len(whole_logits)
    for a, b in zip(split_logits, whole_logits):  # rows in sampling order, the same function of the same inputs
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("preset", ["random:tiny-gemma3"])
def test_overlap_with_a_block_table_per_kv_group(preset):
    prompts, params = _workload(3)
    expected, _ = run_to_completion(_engine(False, preset=preset), prompts, params)
    got, kinds = run_to_completion(_engine(True, preset=preset), prompts, params)
    assert got == expected and "overlap" in kinds


def test_tokens_in_flight_reach_both_parts_under_async_scheduling():
    """Async: a decode's input is the previous step's sample, still on the device; in an overlapped step it must
    land in the decode graph's static inputs (and a recompute ending in it, in the chunk part's)."""
    prompts, params = _workload(11)
    expected, _ = run_to_completion(_engine(False, "off"), prompts, params)
    core = _engine(True, "on")
    got, kinds = run_to_completion(core, prompts, params)
    assert got == expected and "overlap" in kinds


def test_switching_off_between_steps_runs_steps_whole():
    prompts, params = _workload(5)
    core = _engine(True)
    core.runner.overlap.enabled = False
    got, kinds = run_to_completion(core, prompts, params)
    assert "overlap" not in kinds and "piecewise" in kinds
    assert got == run_to_completion(_engine(False), prompts, params)[0]


def test_the_flag_is_checked_and_reported():
    with pytest.raises(InvalidRequestError, match="mixed_overlap"):
        EngineConfig(mixed_overlap="maybe").validate()
    config = EngineConfig(model="random:tiny", device="cpu", dtype="float32", num_kv_blocks=64,
                          mixed_overlap="on")
    core = EngineCore.from_config(config, SchedulerConfig(chunk_size=16, max_num_seqs=4))
    # On the CPU no graph is captured: the switch exists but no step can split.
    assert "mixed-step overlap" in core.startup_summary()
