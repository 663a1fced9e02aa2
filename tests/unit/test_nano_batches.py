"""A step as two halves pipelined layer by layer (nano_batches.py) on the CPU: both halves' piecewise graphs
recorded instead of captured, so the cut itself runs here (where a step is cut, a chunk cut in two, each half's
static inputs and metadata, the sampled rows put back in order, tokens still in flight under async scheduling) and
must give the whole step's logits and greedy tokens. On the GPU the halves also run on two streams
(tests/gpu/test_mixed_gpu.py)."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from engine_fakes import attach_recorded_graphs, record_logits

from metronome.contract.config import SchedulerConfig
from metronome.server.engine.config import EngineConfig
from metronome.server.engine.cuda_graphs import capture_recorded
from metronome.server.engine.engine import EngineCore
from metronome.server.engine.nano_batches import CUT_ALIGN, NanoPipeline, lane_b_buckets, nano_cut, split_batch
from metronome.server.engine.sampling import SamplingParams
from metronome_testing.engine_runs import run_to_completion

MIN = 8  # the tests' floor on a half's tokens (NANO_MIN_TOKENS is sized for an H200's matmuls)


def test_a_mixed_step_is_cut_near_its_middle_when_both_halves_are_big_enough():
    assert nano_cut(383, 100, 192) == 0  # a half would be under the floor: whole
    assert nano_cut(384, 100, 192) == 192
    assert nano_cut(400, 100, 192) == 200  # 200 would round up to 256 and leave B 144: the exact middle instead
    assert nano_cut(576, 65, 192) == 320  # 64 decodes + a 512 chunk: A fills its 320-token bucket exactly
    assert nano_cut(2969, 922, 192) == 1536  # saturation: 921 decodes + a 2,048 chunk
    assert nano_cut(714, 714, 192) == 0  # decode-only: whole
    for n in range(16, 3000, 7):
        cut = nano_cut(n, 3, MIN)
        if cut:
            assert MIN <= cut and MIN <= n - cut and (cut % CUT_ALIGN == 0 or cut == n // 2)


def test_the_second_half_needs_the_buckets_from_the_floor_to_half_the_largest():
    assert lane_b_buckets([8, 16, 64, 192, 256, 320, 1024, 4096], 192) == [192, 256, 320, 1024]
    assert lane_b_buckets([16, 32, 64], 8) == [16, 32]
    assert lane_b_buckets([16, 32, 64], 100) == []  # no step is long enough to cut


def _cu(q_lens):
    cu = np.zeros(len(q_lens) + 1, dtype=np.int64)
    np.cumsum(q_lens, out=cu[1:])
    return cu


def test_a_chunk_the_cut_falls_inside_is_in_both_halves_and_keeps_its_order():
    q_lens = np.array([1, 1, 1, 40, 30])
    seq_lens = np.array([50, 60, 70, 140, 30])  # the 40-token chunk starts at position 100
    a, b = split_batch(_cu(q_lens), q_lens, seq_lens, 20)
    assert (a.first, a.end, a.q_lens.tolist(), a.seq_lens.tolist()) == (0, 4, [1, 1, 1, 17], [50, 60, 70, 117])
    assert (b.first, b.end, b.q_lens.tolist(), b.seq_lens.tolist()) == (3, 5, [23, 30], [140, 30])
    assert a.cu_seqlens[-1] + b.cu_seqlens[-1] == q_lens.sum()


def test_a_cut_on_a_sequence_boundary_shares_nothing():
    q_lens = np.array([1, 1, 40, 30])
    seq_lens = np.array([5, 6, 40, 90])
    a, b = split_batch(_cu(q_lens), q_lens, seq_lens, 42)
    assert (a.first, a.end, a.q_lens.tolist()) == (0, 3, [1, 1, 40])
    assert (b.first, b.end, b.q_lens.tolist(), b.seq_lens.tolist()) == (3, 4, [30], [90])
    with pytest.raises(ValueError):
        split_batch(_cu(q_lens), q_lens, seq_lens, 72)


def _engine(pipelined: bool, async_mode: str = "off", preset: str = "random:tiny", chunk: int = 24) -> EngineCore:
    config = EngineConfig(model=preset, device="cpu", dtype="float32", attention_backend="torch", block_size=16,
                          num_kv_blocks=256, seed=5, async_scheduling=async_mode)
    core = EngineCore.from_config(config, SchedulerConfig(chunk_size=chunk, max_num_seqs=16, queue_policy="fcfs"))
    attach_recorded_graphs(core, [2, 4, 8, 16])
    runner = core.runner
    pieces = runner.piecewise_runner([16, 32, 64], capture_recorded)
    pieces.capture_all()
    runner.attach_pieces(pieces)
    if pipelined:
        runner.pipeline = NanoPipeline(runner.device)
        assert runner.capture_pipeline_lane(capture_recorded, MIN)
        assert runner.pipeline.lane_b.buckets == [16, 32]  # up to half the largest of the runner's own
    return core


@pytest.fixture(autouse=True)
def _small_halves(monkeypatch):
    """Cut the tiny model's steps from 2 x MIN tokens (the runner reads the floor through nano_cut's default)."""
    import metronome.server.engine.model_runner as model_runner

    monkeypatch.setattr(model_runner, "nano_cut", lambda n, seqs: nano_cut(n, seqs, MIN))


def _workload(seed: int, n: int = 9):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(1, 70))] for _ in range(n)]
    params = [SamplingParams(max_tokens=2 + 3 * (i % 4), temperature=0.0, ignore_eos=True) for i in range(n)]
    return prompts, params


def test_pipelined_steps_give_the_whole_steps_logits_and_greedy_tokens():
    prompts, params = _workload(7)
    whole, cut = _engine(False), _engine(True)
    whole_logits, cut_logits = record_logits(whole), record_logits(cut)
    expected, whole_kinds = run_to_completion(whole, prompts, params)
    got, kinds = run_to_completion(cut, prompts, params)
    assert got == expected
    assert "pipeline" in kinds and "pipeline" not in whole_kinds
    assert kinds.count("pipeline") == whole_kinds.count("piecewise") - kinds.count("piecewise")
    assert len(cut_logits) == len(whole_logits)
    for a, b in zip(cut_logits, whole_logits):  # rows in sampling order, the same function of the same inputs
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_a_prompt_alone_is_cut_inside_its_chunk():
    """One 40-token prompt at chunk 48: its only step is cut at token 20, B's rows attend to A's K/V."""
    rng = random.Random(2)
    prompt = [[rng.randrange(3, 512) for _ in range(40)]]
    params = [SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)]
    expected, _ = run_to_completion(_engine(False, chunk=48), prompt, params)
    got, kinds = run_to_completion(_engine(True, chunk=48), prompt, params)
    assert got == expected and kinds[0] == "pipeline"


def test_pipelining_with_a_block_table_per_kv_group():
    prompts, params = _workload(3)
    expected, _ = run_to_completion(_engine(False, preset="random:tiny-gemma3"), prompts, params)
    got, kinds = run_to_completion(_engine(True, preset="random:tiny-gemma3"), prompts, params)
    assert got == expected and "pipeline" in kinds


def _decodes_then_a_prompt(core: EngineCore):
    """14 sequences decoding, then a 40-token prompt: at chunk 8 its steps carry 14 decodes and 8 prompt tokens, cut
    at token 11, so three decodes (whose input is the step in flight's sample, under async scheduling) are B's."""
    rng = random.Random(8)
    ids = [core.add_request([rng.randrange(3, 512) for _ in range(2)],
                            SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)) for _ in range(14)]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    kinds = []
    for step in range(200):
        if step == 4:
            ids.append(core.add_request([rng.randrange(3, 512) for _ in range(40)],
                                        SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)))
            tokens[ids[-1]] = []
        if not core.has_unfinished():
            break
        events, stats = core.step()
        if stats.num_tokens:
            kinds.append((stats.forward, stats.num_decode_tokens, stats.num_prefill_tokens))
        for e in events:
            if e.token_id >= 0:
                tokens[e.request_id].append(e.token_id)
    core.check_no_leaks()
    return [tokens[rid] for rid in ids], kinds


@pytest.mark.parametrize("async_mode", ["off", "on"])
def test_decodes_past_the_cut_get_their_tokens(async_mode):
    expected, _ = _decodes_then_a_prompt(_engine(False, "off", chunk=8))
    got, kinds = _decodes_then_a_prompt(_engine(True, async_mode, chunk=8))
    assert got == expected
    assert ("pipeline", 14, 8) in kinds  # decodes 11 to 13 were B's rows


def test_tokens_in_flight_reach_both_halves_under_async_scheduling():
    prompts, params = _workload(11, n=14)
    expected, _ = run_to_completion(_engine(False, "off"), prompts, params)
    got, kinds = run_to_completion(_engine(True, "on"), prompts, params)
    assert got == expected and "pipeline" in kinds


def test_switching_off_between_steps_runs_steps_whole():
    prompts, params = _workload(5)
    core = _engine(True)
    core.runner.pipeline.enabled = False
    got, kinds = run_to_completion(core, prompts, params)
    assert "pipeline" not in kinds and "piecewise" in kinds
    assert got == run_to_completion(_engine(False), prompts, params)[0]


def test_a_half_no_bucket_holds_runs_the_step_whole():
    """A 100-token step is cut at 64, and B's lane holds 32 tokens: the step runs whole."""
    rng = random.Random(4)
    prompt = [[rng.randrange(3, 512) for _ in range(100)]]
    params = [SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)]
    got, kinds = run_to_completion(_engine(True, chunk=128), prompt, params)
    assert got == run_to_completion(_engine(False, chunk=128), prompt, params)[0]
    assert kinds[0] == "eager" and "pipeline" not in kinds


def test_the_flag_is_reported():
    config = EngineConfig(model="random:tiny", device="cpu", dtype="float32", num_kv_blocks=64,
                          mixed_overlap="pipeline")
    core = EngineCore.from_config(config, SchedulerConfig(chunk_size=16, max_num_seqs=4))
    # On the CPU no graph is captured: the switch exists but no step can be cut.
    assert core.overlap_mode == "pipeline" and "mixed-step overlap pipeline" in core.startup_summary()
