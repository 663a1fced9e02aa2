"""The FP8 accuracy measurement (metronome_testing.fp8_accuracy, which the GPU test and hack/fp8_accuracy.py run on
real weights) on a tiny random model on the CPU: a model scored against itself differs by nothing, and FP8 differs
a little, each variant with its own cache dtype."""
from __future__ import annotations

from metronome.contract.config import SchedulerConfig
from metronome.server.engine.config import EngineConfig
from metronome.server.engine.engine import EngineCore
from metronome_testing import fp8_accuracy


def _engine(quantization: str | None, kv_cache_dtype: str) -> EngineCore:
    config = EngineConfig(model="random:tiny", device="cpu", dtype="float32", attention_backend="torch",
                          block_size=16, num_kv_blocks=256, seed=3, quantization=quantization,
                          kv_cache_dtype=kv_cache_dtype)
    return EngineCore.from_config(config, SchedulerConfig(chunk_size=64, max_num_seqs=8, queue_policy="fcfs"))


def test_the_reference_scored_against_itself_differs_by_nothing():
    result = fp8_accuracy.measure(lambda quantization, kv: _engine(None, "auto"), "tiny", prompt_count=3,
                                  new_tokens=6)
    for label, _ in fp8_accuracy.VARIANTS:
        row = result[label]
        assert row["quantization"] is None and row["kv_cache"] == "float32"
        assert row["identical_outputs"] == 3 and row["token_agreement_by_position"] == 1.0
        assert row["mean_matching_prefix_tokens"] == 6
        assert row["mean_abs_logprob_delta_on_reference_tokens"] == 0.0 and row["p99_abs_logprob_delta"] == 0.0


def test_fp8_weights_and_cache_are_measured_against_the_reference():
    result = fp8_accuracy.measure(_engine, "tiny", prompt_count=3, new_tokens=6)
    assert (result["prompts"], result["new_tokens"], result["reference_dtype"]) == (3, 6, "float32")
    weights, cache = result["fp8_weights"], result["fp8_weights_fp8_kv"]
    assert "per-channel" in weights["quantization"] and weights["kv_cache"] == "float32"
    assert cache["kv_cache"] == "float8_e4m3fn" and cache["kv_scales"] == "calibrated"
    for row in (weights, cache):
        assert 0 < row["mean_abs_logprob_delta_on_reference_tokens"] < 0.05  # FP8 rounding: small, never none
        assert row["p99_abs_logprob_delta"] >= row["mean_abs_logprob_delta_on_reference_tokens"]
