"""`bench engine --sections saturation`: how many requests fill the KV cache, the floor arithmetic, the notes about
steps that missed a decode graph, and an end-to-end run on the CPU engine (random:tiny): N comes from the KV
cache, every request makes exactly the output length, the decode part is pure decode."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from metronome.server.bench.engine import model_math
from metronome.server.bench.engine.saturation import (
    SatStep,
    plan_requests,
    requests_that_fit,
    saturation_section,
    summarize,
)
from metronome.server.bench.engine.sections import EngineBenchError
from metronome.server.models.presets import preset_config


def test_requests_that_fit_count_whole_blocks():
    # The H200 run's cache: 55,367 blocks of 16, 1 % watermark (553 blocks) -> 54,814 usable; 2,000 tokens = 125 blocks.
    assert requests_that_fit(55_367 - 553, 16, 1000, 1000) == 438
    # 20 + 12 = 32 tokens = 2 blocks; 33 tokens need 3 blocks.
    assert requests_that_fit(39, 16, 20, 12) == 19
    assert requests_that_fit(39, 16, 21, 12) == 13
    assert plan_requests(39, 16, 20, 12, cap=512) == 19
    assert plan_requests(39, 16, 20, 12, cap=5) == 5
    with pytest.raises(EngineBenchError, match="--saturation-prompt-len"):
        plan_requests(1, 16, 20, 12, cap=512)


def test_floor_tokens_per_s_by_hand_for_llama3_8b():
    config = preset_config("llama-3-8b")
    weights, kv = model_math.weights_read_per_decode_step(config, 2), model_math.kv_bytes_per_token(config, 2)
    assert kv == 2 * 32 * 8 * 128 * 2
    # 400 decodes over a mean of 1,500 tokens each at 4.25 TB/s.
    step_bytes = weights + kv * 400 * 1500
    assert model_math.decode_floor_tokens_per_s(weights, kv, 400, 400 * 1500, 4.25e12) == pytest.approx(
        400 / (step_bytes / 4.25e12))


def test_summary_of_a_tiny_run_by_hand():
    weight_bytes, kv_bytes, bandwidth = 1000, 10, 1e5
    steps = [SatStep(0.5, 64, 0, 2, 0, "piecewise"),  # prompts
             SatStep(0.1, 8, 2, 3, 42, "piecewise"),  # the last prompt chunk with 2 decodes: not the decode part
             SatStep(0.02, 0, 3, 3, 66, "graph"),
             SatStep(0.03, 0, 3, 3, 69, "graph"),
             SatStep(0.01, 0, 1, 1, 24, "eager")]
    got = summarize(steps, weight_bytes, kv_bytes, bandwidth, decode_graph_max_batch=2)
    whole, part = got["whole_run"], got["decode_part"]
    assert whole["steps"] == 5 and whole["output_tokens"] == 12 and whole["prefill_steps"] == 2
    assert whole["output_tokens_per_s"] == pytest.approx(12 / 0.66)
    assert whole["forward"] == {"graph": 2, "piecewise": 2, "overlap": 0, "eager": 1}
    assert part["steps"] == 3 and part["output_tokens"] == 7
    assert part["output_tokens_per_s"] == pytest.approx(7 / 0.06)
    assert part["mean_batch"] == pytest.approx(7 / 3) and part["mean_kv_tokens_read"] == pytest.approx(53)
    # Σ tokens / Σ per-step floor times over the same steps
    floor_times = [(weight_bytes + kv_bytes * s.kv_tokens_read) / bandwidth for s in steps[2:]]
    assert part["floor_tokens_per_s"] == pytest.approx(7 / sum(floor_times))
    assert part["floor_step_ms"] == pytest.approx(1000 * sum(floor_times) / 3)
    assert part["ratio_to_floor"] == pytest.approx(0.06 / sum(floor_times))
    assert part["forward"] == {"graph": 2, "piecewise": 0, "overlap": 0, "eager": 1}
    assert got["notes"] == ["1 of 3 decode steps did not replay a decode CUDA graph (0 piecewise, 1 eager; decode "
                            "graphs are captured for batches up to 2; the largest decode batch was 3)"]


def test_all_graph_decode_steps_leave_no_note_and_no_bandwidth_no_floor():
    steps = [SatStep(0.1, 16, 0, 2, 0, "piecewise"), SatStep(0.01, 0, 2, 2, 40, "graph")]
    got = summarize(steps, 1000, 10, None, decode_graph_max_batch=8)
    assert got["notes"] == [] and "floor_tokens_per_s" not in got["decode_part"]
    assert got["decode_part"]["floor_bytes_per_step"] == 1000 + 10 * 40


def test_a_run_that_never_decodes_says_so():
    got = summarize([SatStep(0.1, 16, 0, 2, 0, "eager")], 1000, 10, 1e5, None)
    assert got["decode_part"] == {"steps": 0} and "no pure-decode step" in got["notes"][0]


@pytest.fixture(scope="module")
def tiny_core():
    from metronome.contract.config import SchedulerConfig
    from metronome.server.engine.config import EngineConfig
    from metronome.server.engine.engine import EngineCore

    # 40 blocks of 16, watermark 1 block: 39 usable -> 19 requests of 20 + 12 tokens (2 blocks each).
    config = EngineConfig(model="random:tiny", device="cpu", dtype="float32", num_kv_blocks=40, max_model_len=256)
    core = EngineCore.from_config(config, SchedulerConfig(max_num_seqs=4))
    yield core
    core.close()


def _sampler(core):
    from metronome.server.bench.load.inprocess import sampler_for_engine

    return sampler_for_engine(core)


def test_saturation_on_the_cpu_engine_fills_the_cache_and_makes_every_token(tiny_core):
    got = saturation_section(tiny_core, 20, 12, max_requests=512, chunk=64, sampler=_sampler(tiny_core), seed=0,
                             bandwidth=1e9, dtype_bytes=4)
    assert got["kv_blocks_usable"] == 39 and got["requests_that_fit"] == 19 and got["requests"] == 19
    whole, part = got["whole_run"], got["decode_part"]
    assert whole["output_tokens"] == 19 * 12 and whole["prefill_tokens"] == 19 * 20 and whole["preemptions"] == 0
    assert whole["prefill_steps"] == math.ceil(19 * 20 / 64)
    assert part["steps"] > 0 and part["max_batch"] <= 19 and part["forward"]["eager"] == part["steps"]
    # A pure-decode step's decodes read their prompt and every token before the one they make.
    assert 19 * 20 < part["mean_kv_tokens_read"] <= 19 * (20 + 12)
    config = tiny_core.loaded.config
    expected = model_math.decode_floor_tokens_per_s(model_math.weights_read_per_decode_step(config, 4),
                                                    model_math.kv_bytes_per_token(config, 4), part["mean_batch"],
                                                    part["mean_kv_tokens_read"], 1e9)
    assert part["floor_tokens_per_s"] == pytest.approx(expected)
    assert not tiny_core.has_unfinished() and tiny_core.scheduler.config.max_num_seqs == 19


def test_saturation_cap_and_bad_lengths(tiny_core):
    got = saturation_section(tiny_core, 20, 12, max_requests=3, chunk=16, sampler=_sampler(tiny_core), seed=1,
                             bandwidth=None, dtype_bytes=4)
    assert got["requests"] == 3 and got["whole_run"]["output_tokens"] == 36
    assert any("capped at --saturation-max-requests 3" in n for n in got["notes"])
    with pytest.raises(EngineBenchError, match="max_model_len 256"):
        saturation_section(tiny_core, 200, 100, 512, 64, _sampler(tiny_core), 0, None, 4)


def test_floor_is_the_decode_floor_of_the_mean_context():
    # The same number as the decode section's floor for a batch whose contexts sum to the mean KV tokens.
    config = SimpleNamespace(vocab_size=10, hidden_size=4, intermediate_size=8, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=1, head_dim=2, tie_word_embeddings=False,
                             num_parameters=lambda: 500)
    weights, kv = model_math.weights_read_per_decode_step(config, 2), model_math.kv_bytes_per_token(config, 2)
    assert (weights, kv) == ((500 - 40) * 2, 2 * 2 * 1 * 2 * 2)
    floor_bytes = model_math.decode_floor_bytes(config, 2, [30, 50, 40])
    assert model_math.decode_floor_tokens_per_s(weights, kv, 3, 120, 1e6) == pytest.approx(3 * 1e6 / floor_bytes)
