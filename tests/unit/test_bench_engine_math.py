"""`metronome bench engine`'s arithmetic: HBM floors, prefill FLOPs, capacity per chunk, targets, and the
transformers adapter's pure parts."""
from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from metronome.server.bench.engine import model_math
from metronome.server.bench.engine.command import evaluate_targets
from metronome.server.bench.engine.hf_peer import llama_config_for, records_from_outputs
from metronome.server.bench.engine.sections import UNCHUNKED, capacity_table, overlap_comparison
from metronome.server.bench.load.results import RunEntry
from metronome.server.bench.load.stats import LatencySummary, RunSummary
from metronome.server.models.presets import preset_config

LLAMA3_8B = preset_config("llama-3-8b")
H200_COPY = 4.3e12  # bytes/s: the copy bandwidth measured on an H200 (4.8 TB/s on the data sheet)


def test_llama3_8b_decode_floor_matches_the_reference_arithmetic():
    assert model_math.weights_read_per_decode_step(LLAMA3_8B, 2) == pytest.approx(15.0e9, rel=0.002)
    assert model_math.kv_bytes_per_token(LLAMA3_8B, 2) == 128 * 1024
    floors_ms = {b: model_math.decode_floor_bytes(LLAMA3_8B, 2, [2048] * b) / H200_COPY * 1000 for b in (1, 64, 256)}
    assert floors_ms[1] == pytest.approx(3.55, abs=0.01)
    assert floors_ms[64] == pytest.approx(7.49, abs=0.01)
    assert floors_ms[256] == pytest.approx(19.5, abs=0.05)


def test_fp8_floors_count_fp8_linear_weights_their_scales_and_an_fp8_kv_cache():
    fp8 = model_math.ByteWidths(dtype=2, linear=1, kv=1, scales_per_row=1.0)  # per-channel scales
    linear = LLAMA3_8B.num_hidden_layers * model_math.linear_params_per_layer(LLAMA3_8B)
    rows = LLAMA3_8B.num_hidden_layers * model_math.linear_rows_per_layer(LLAMA3_8B)
    bf16 = model_math.weights_read_per_decode_step(LLAMA3_8B, 2)
    assert model_math.weights_read_per_decode_step(LLAMA3_8B, fp8) == bf16 - linear + 4 * rows
    assert model_math.weights_read_per_decode_step(LLAMA3_8B, fp8) == pytest.approx(8.04e9, rel=0.002)
    assert rows == 32 * (4096 + 2 * 1024 + 4096 + 2 * 14336 + 4096)
    assert model_math.kv_bytes_per_token(LLAMA3_8B, fp8) == 64 * 1024
    assert model_math.decode_floor_bytes(LLAMA3_8B, fp8, [2048] * 64) / model_math.decode_floor_bytes(
        LLAMA3_8B, 2, [2048] * 64) == pytest.approx(0.52, abs=0.01)


def test_tied_embeddings_are_read_once_as_the_lm_head():
    smol = preset_config("smollm2-135m")
    assert smol.tie_word_embeddings
    assert model_math.weights_read_per_decode_step(smol, 2) == smol.num_parameters() * 2


def test_prefill_flops_by_hand_for_a_toy_shape():
    toy = SimpleNamespace(vocab_size=10, hidden_size=4, intermediate_size=8, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=2)
    linear = 2 * (4 * (4 + 2 * 2) + 4 * 4 + 3 * 4 * 8)  # layers x (qkv + o + mlp) = 2 x 144
    expected = 2 * linear * 3 + 4 * 2 * 2 * 2 * (3 * 4 / 2) + 2 * 10 * 4
    assert model_math.prefill_flops(toy, [3]) == pytest.approx(expected)
    assert model_math.prefill_flops(LLAMA3_8B, [2048]) / 2048 == pytest.approx(14.5e9, rel=0.01)


def test_window_layers_read_only_their_window_and_head_dim_is_the_configs():
    gemma = preset_config("gemma-3-12b")  # 48 layers: 40 with a 1,024-token window, 8 global; head_dim 256
    per_layer_token = 2 * 8 * 256 * 2
    assert model_math.kv_bytes_per_token(gemma, 2) == 48 * per_layer_token
    assert model_math.kv_bytes_read(gemma, 2, 800) == 48 * 800 * per_layer_token  # within every window
    assert model_math.kv_bytes_read(gemma, 2, 8192) == (40 * 1024 + 8 * 8192) * per_layer_token
    floor = model_math.decode_floor_bytes(gemma, 2, [8192] * 64)
    assert floor == model_math.weights_read_per_decode_step(gemma, 2) + 64 * (40 * 1024 + 8 * 8192) * per_layer_token
    # q is 16 heads x 256 = 4,096 wide on a 3,840 hidden: linear params use head_dim, not hidden / heads
    assert model_math.linear_params_per_layer(gemma) == 3840 * (4096 + 2 * 2048) + 4096 * 3840 + 3 * 3840 * 15360
    qwen = preset_config("qwen3-8b")
    assert model_math.weights_read_per_decode_step(qwen, 2) == pytest.approx(15.14e9, rel=0.001)  # 8.19 B - input table


def test_prefill_pairs_of_a_window_layer():
    toy = SimpleNamespace(vocab_size=10, hidden_size=4, intermediate_size=8, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=2, layer_windows=(2, None))
    linear = 2 * (4 * (4 + 2 * 2) + 4 * 4 + 3 * 4 * 8)
    pairs = (1 + 2 + 2) + (1 + 2 + 3)  # window 2: queries see 1, 2, 2 keys; full: 1, 2, 3
    assert model_math.prefill_flops(toy, [3]) == pytest.approx(2 * linear * 3 + 4 * 2 * 2 * pairs + 2 * 10 * 4)


def run(chunk, rate, tput, p99, done=10):
    summary = RunSummary(num_requests=10, num_completed=done, output_tokens_per_s=tput,
                         tbt=LatencySummary(count=50, p99_ms=p99), ttft=LatencySummary(count=10, p99_ms=p99 * 3))
    return RunEntry(f"{chunk}@{rate}", {"chunk_size": chunk, "rate": rate}, summary)


def test_capacity_table_compares_every_chunk_with_unchunked():
    runs = [run(512, 4, 400, 20), run(512, 8, 780, 28), run(512, 16, 900, 60),
            run(UNCHUNKED, 4, 410, 25), run(UNCHUNKED, 8, 800, 80), run(UNCHUNKED, 16, 1000, 200),
            run(256, 4, 390, 10), run(256, 8, 700, 12, done=9)]  # an unfinished run never counts as capacity
    rows = {r["chunk_size"]: r for r in capacity_table(runs, slo_tbt_ms=30)}
    assert rows[512]["capacity_rate"] == 8 and rows[UNCHUNKED]["capacity_rate"] == 4
    assert rows[512]["capacity_ratio_vs_unchunked"] == pytest.approx(2.0)
    assert rows[512]["throughput_cost_vs_unchunked"] == pytest.approx(0.1)
    assert rows[512]["tbt_p99_ms_at_highest_rate"] == 60 and rows[512]["highest_rate"] == 16
    assert rows[256]["capacity_rate"] == 4 and rows[UNCHUNKED]["label"] == "unchunked"
    assert "capacity_ratio_vs_unchunked" not in rows[UNCHUNKED]


def test_overlap_variants_get_rows_of_their_own_and_a_comparison():
    def variant(entry, name):
        entry.params["mixed_overlap"] = name
        return entry

    runs = [variant(run(512, 45, 900, 40), "off"), variant(run(512, 45, 920, 30), "on"),
            variant(run(512, 60, 1000, 50), "off"), variant(run(512, 60, 990, 45, done=9), "on")]
    rows = {r["label"]: r for r in capacity_table(runs, slo_tbt_ms=35)}
    assert set(rows) == {"512, overlap off", "512, overlap on"}
    assert rows["512, overlap on"]["capacity_rate"] == 45 and rows["512, overlap off"]["capacity_rate"] is None
    pairs = {r["rate"]: r for r in overlap_comparison(runs)}
    assert pairs[45]["tbt_p99_reduction"] == pytest.approx(0.25)
    assert pairs[45]["throughput_change"] == pytest.approx(920 / 900 - 1)
    assert pairs[60]["completed"] == (True, False)
    assert overlap_comparison([run(512, 45, 900, 40)]) == []  # runs without variants: nothing to compare


def test_capacity_ratio_when_unchunked_never_meets_the_slo():
    rows = {r["chunk_size"]: r for r in capacity_table([run(512, 4, 400, 20), run(UNCHUNKED, 4, 410, 90)], 30)}
    assert rows[512]["capacity_ratio_vs_unchunked"] is None and "unbounded" in rows[512]["note"]


def test_targets_report_values_and_verdicts():
    doc = {
        "decode": [{"batch": 1, "ratio_to_floor": 1.2, "scheduler_overhead_share": 0.2},
                   {"batch": 64, "ratio_to_floor": 1.5, "scheduler_overhead_share": 0.05}],
        "prefill": {"share_of_matmul_peak": 0.65},
        "longshort": {"capacity": [{"chunk_size": 512, "tbt_p99_ms_at_highest_rate": 25.0,
                                    "throughput_cost_vs_unchunked": 0.08, "capacity_ratio_vs_unchunked": 1.5}]},
        "batch_comparison": {"output_tokens_per_s_ratio": 12.0},
    }
    verdicts = {t["key"]: (t["value"], t["met"]) for t in evaluate_targets(doc)}
    assert verdicts["decode_b1_ratio_to_floor"] == (1.2, True)
    assert verdicts["decode_b64_ratio_to_floor"] == (1.5, False)
    assert verdicts["prefill_share_of_matmul_peak"] == (0.65, True)
    assert verdicts["chunk512_tbt_p99_ms_at_highest_rate"] == (25.0, True)
    assert verdicts["chunk512_throughput_cost_vs_unchunked"] == (0.08, True)
    assert verdicts["chunk512_capacity_ratio_vs_unchunked"] == (1.5, False)
    assert verdicts["output_tokens_per_s_ratio_vs_transformers"] == (12.0, True)
    assert verdicts["host_overhead_share_b64"] == (0.05, True)
    assert all(t["met"] is None for t in evaluate_targets({}))  # nothing measured, nothing claimed


def test_transformers_config_has_our_shape():
    import transformers

    cfg = llama_config_for(preset_config("tiny"), transformers)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size) == (512, 64, 2, 4, 2, 16, 128)


def test_generation_outputs_become_records_on_one_clock():
    outputs = [
        SimpleNamespace(created_time=100.0, timestamps=[100.5, 100.6, 100.8], generated_tokens=[1, 2, 3],
                        prompt_ids=[9] * 50, lifespan=(100.1, 100.8), error=None),
        SimpleNamespace(created_time=100.2, timestamps=None, generated_tokens=[4, 5], prompt_ids=[9] * 20,
                        lifespan=(100.3, 101.0), error=None),
        SimpleNamespace(created_time=100.2, timestamps=[], generated_tokens=[], prompt_ids=[9], lifespan=(-1, -1),
                        error="out of blocks"),
    ]
    records = records_from_outputs(outputs, ["long", "short", "short"])
    first, second, failed = records
    assert first.sent_s == 0.0 and first.token_times_s == pytest.approx([0.5, 0.6, 0.8])
    assert first.end_s == pytest.approx(0.8) and first.output_tokens == 3 and first.prompt_tokens == 50
    assert second.token_times_s == [] and second.end_s == pytest.approx(1.0) and second.output_tokens == 2
    assert failed.error == "transformers: out of blocks" and not failed.ok


def test_effective_kv_tokens_turn_window_reads_into_every_layer_tokens():
    gemma = preset_config("gemma-3-12b")
    for context in (100, 1024, 5000):
        assert model_math.kv_bytes_per_token(gemma, 2) * model_math.effective_kv_tokens(gemma, context) == \
            pytest.approx(model_math.kv_bytes_read(gemma, 2, context))
    assert model_math.effective_kv_tokens(LLAMA3_8B, 5000) == 5000


def test_moe_decode_floor_reads_only_the_experts_the_batch_picks():
    qwen = preset_config("qwen3-30b-a3b")  # 48 sparse layers of 128 experts (3 x 2048 x 768 each), top-8
    expert_bytes = 3 * 2048 * 768 * 2
    every_expert = model_math.weights_read_per_decode_step(qwen, 2)
    others = every_expert - 48 * 128 * expert_bytes  # attention, norms, routers, the LM head
    assert others == pytest.approx(2 * (48 * (2048 * (4096 + 1024) + 4096 * 2048 + 2 * 128 + 2 * 2048
                                              + 128 * 2048) + 2048 + 151936 * 2048), rel=1e-9)
    assert model_math.weights_read_per_decode_step(qwen, 2, batch=1) == pytest.approx(
        others + 48 * 8 * expert_bytes, rel=1e-9)
    at_64 = model_math.weights_read_per_decode_step(qwen, 2, batch=64)
    assert at_64 == pytest.approx(others + 48 * 128 * (1 - (1 - 8 / 128) ** 64) * expert_bytes, rel=1e-9)
    assert model_math.weights_read_per_decode_step(qwen, 2, batch=4096) == pytest.approx(every_expert, rel=1e-6)
    floors_ms = {b: model_math.decode_floor_bytes(qwen, 2, [2048] * b) / H200_COPY * 1000
                 for b in (1, 64, 256)}
    assert floors_ms[1] < 0.1 * floors_ms[64] < floors_ms[256]
    dense = preset_config("llama-3-8b")  # a dense model reads the same weights at any batch
    assert model_math.weights_read_per_decode_step(dense, 2, batch=1) == model_math.weights_read_per_decode_step(
        dense, 2)


def test_fp8_moe_floors_count_fp8_attention_and_experts_by_their_own_widths():
    qwen = preset_config("qwen3-30b-a3b")
    attention = 2048 * (4096 + 1024) + 4096 * 2048
    expert_params, expert_rows = 3 * 2048 * 768, 2 * 768 + 2048
    bf16 = model_math.weights_read_per_decode_step(qwen, 2, batch=64)
    read = 48 * 128 * (1 - (1 - 8 / 128) ** 64)  # experts a batch of 64 picks, over the 48 sparse layers
    assert model_math.fp8_linear_params_and_rows(qwen) == (48 * attention, 48 * (4096 + 2 * 512 + 2048))
    online = model_math.ByteWidths(dtype=2, linear=1, kv=1, scales_per_row=1.0)  # experts stay bf16
    assert model_math.weights_read_per_decode_step(qwen, online, batch=64) == pytest.approx(
        bf16 - 48 * attention + 4 * 48 * (4096 + 1024 + 2048), rel=1e-9)
    checkpoint = model_math.ByteWidths(dtype=2, linear=1, kv=1, scales_per_row=16.0, experts=1,
                                       expert_scales_per_row=8.0)  # 128-column groups
    assert model_math.weights_read_per_decode_step(qwen, checkpoint, batch=64) == pytest.approx(
        bf16 - 48 * attention + 16 * 4 * 48 * (4096 + 1024 + 2048) - read * expert_params
        + 8 * 4 * read * expert_rows, rel=1e-9)
    shared = replace(qwen, moe=replace(qwen.moe, shared_expert_intermediate_size=512))  # runs W8A8 too
    assert model_math.fp8_linear_params_and_rows(shared) == (48 * (attention + 3 * 2048 * 512),
                                                             48 * (4096 + 2 * 512 + 2048 + 2 * 512 + 2048))


def test_moe_prefill_counts_the_active_experts_only():
    qwen = preset_config("qwen3-30b-a3b")
    active = 48 * (2048 * 5120 + 4096 * 2048 + 2048 * 128 + 8 * 3 * 2048 * 768)  # attention, router, 8 experts
    assert model_math.active_linear_params(qwen) == active
    assert model_math.active_linear_params(LLAMA3_8B) == 32 * model_math.linear_params_per_layer(LLAMA3_8B)
    mixed = preset_config("tiny-qwen3-moe")  # layer 1 is dense
    dense_mlp = 3 * 64 * 128
    sparse_mlp = 64 * 8 + 2 * 3 * 64 * 64
    attention = model_math.linear_params_per_layer(mixed) - dense_mlp
    assert model_math.active_linear_params(mixed) == 3 * attention + 2 * sparse_mlp + dense_mlp


def test_the_transformers_peer_refuses_the_mixtures_of_experts():
    from metronome.server.bench.engine.hf_peer import HFPeerError

    for preset in ("qwen3-30b-a3b", "gpt-oss-20b", "mixtral-8x7b"):
        with pytest.raises(HFPeerError, match="no peer is built"):
            llama_config_for(preset_config(preset), None)
