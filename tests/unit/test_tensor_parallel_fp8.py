"""FP8 under tensor parallelism: each rank cuts an FP8 checkpoint's weights and scales to its part (per-tensor,
per-row and block scales, column- and row-parallel layers, per-head KV-cache scales), a block checkpoint that a
split would cut through is refused naming the sizes, and an engine at TP=2 over gloo gives TP=1's tokens and
logits on FP8 checkpoints with an FP8 KV cache.

TP=2 and TP=1 do the same FP8 math where each rank's slice of a row-parallel input is quantised the way the
whole row is: a static per-tensor input scale, or per-group scales whose groups the split does not cut; logits
then differ by the all-reduce's summation order only. Per-token scales differ (PER_TOKEN_ATOL).
"""
from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from fp8_checkpoints import BLOCK, dequantize_weight, quantize_weight, write_fp8_checkpoint
from safetensors.torch import load_file, save_file
from test_loaders import save_hf_model
from test_tensor_parallel import assert_same_run, one_thread_per_rank, run_recording_logits  # noqa: F401 (a fixture)

from metronome.contract.errors import InvalidRequestError
from metronome.server.models.parallel import check_block_split, plan_shards, shard_for
from metronome.server.models.presets import preset_config

CONFIG = replace(preset_config("tiny"), vocab_size=64, hidden_size=128, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32)
SPLIT = {"q_proj": ("self_attn.q_proj", 0), "o_proj": ("self_attn.o_proj", 1), "up_proj": ("mlp.up_proj", 0),
         "down_proj": ("mlp.down_proj", 1)}


@pytest.mark.parametrize("granularity", ["tensor", "channel", "block"])
@pytest.mark.parametrize("linear", list(SPLIT))
def test_each_ranks_fp8_shard_is_its_part_of_the_dequantised_weight(granularity, linear):
    module, dim = SPLIT[linear]
    plan = plan_shards(CONFIG, 2)
    out_features = {"q_proj": CONFIG.q_size, "up_proj": CONFIG.intermediate_size}.get(linear, CONFIG.hidden_size)
    in_features = {"o_proj": CONFIG.q_size, "down_proj": CONFIG.intermediate_size}.get(linear, CONFIG.hidden_size)
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(1))
    q, scale = quantize_weight(weight, granularity)
    full = dequantize_weight(q, scale, granularity)
    name = f"model.layers.0.{module}"
    block = BLOCK if granularity == "block" else None
    parts = []
    for rank in range(2):
        q_part = shard_for(f"{name}.weight", q, plan, rank, block)
        scale_part = shard_for(f"{name}.weight_scale_inv", scale, plan, rank, block)
        if granularity == "tensor" or (granularity == "channel" and dim == 1):
            assert scale_part is scale  # one scale, or one per output row that every rank's rows have
        parts.append(dequantize_weight(q_part, scale_part, granularity))
    assert torch.equal(torch.cat(parts, dim=dim), full)


@pytest.mark.parametrize("granularity", ["tensor", "channel", "block"])
def test_a_fused_qkv_checkpoint_gives_each_rank_its_rows_of_every_part(granularity):
    """Phi-3's checkpoints fuse q, k and v (and gate and up): a rank's tensor is its q rows, then its k and v rows."""
    plan = plan_shards(CONFIG, 2)
    q, kv = CONFIG.q_size, CONFIG.kv_size
    weight = torch.randn(q + 2 * kv, CONFIG.hidden_size, generator=torch.Generator().manual_seed(2))
    codes, scale = quantize_weight(weight, granularity)
    full = dequantize_weight(codes, scale, granularity)
    block = BLOCK if granularity == "block" else None
    name = "model.layers.0.self_attn.qkv_proj"
    for rank in range(2):
        part = dequantize_weight(shard_for(f"{name}.weight", codes, plan, rank, block),
                                 shard_for(f"{name}.weight_scale", scale, plan, rank, block), granularity)
        half_q, half_kv = q // 2, kv // 2
        expected = torch.cat([full[rank * half_q:(rank + 1) * half_q],
                              full[q + rank * half_kv:q + (rank + 1) * half_kv],
                              full[q + kv + rank * half_kv:q + kv + (rank + 1) * half_kv]])
        assert torch.equal(part, expected)


def test_a_split_through_scale_blocks_is_refused_naming_the_sizes():
    plan = plan_shards(CONFIG, 2)
    check_block_split(plan, (32, 32))  # q rows 64, kv rows 32, MLP 64 a rank: whole blocks
    with pytest.raises(InvalidRequestError, match=r"tensor_parallel_size 2 gives each rank kv rows 32: not whole "
                                                  r"64x64 blocks") as refused:
        check_block_split(plan, (64, 64))
    assert refused.value.param == "tensor_parallel_size"
    with pytest.raises(ValueError, match="cuts its 128-wide scale blocks"):
        shard_for("model.layers.0.self_attn.k_proj.weight_scale_inv", torch.ones(2, 1), plan, 1, (128, 128))


def test_per_head_kv_scales_go_with_their_heads():
    name = "model.layers.0.self_attn.k_scale"
    per_head = torch.tensor([0.25, 0.5])
    split = plan_shards(CONFIG, 2)
    assert [shard_for(name, per_head, split, r).tolist() for r in range(2)] == [[0.25], [0.5]]
    replicated = plan_shards(CONFIG, 4)  # each kv head on two ranks
    assert [shard_for(name, per_head, replicated, r).tolist() for r in range(4)] == [[0.25], [0.25], [0.5], [0.5]]
    one = torch.tensor(0.125)
    assert shard_for("model.layers.0.self_attn.k_proj.output_scale", one, split, 1) is one


def _checkpoint(folder, family: str, layout: str, kv_scales: bool) -> tuple[str, int]:
    """A tiny transformers model of `family` saved in the FP8 `layout`, with per-head KV-cache scales if asked;
    returns (its model spec, its vocabulary)."""
    from transformers import LlamaConfig, Qwen3Config

    shape = dict(vocab_size=333, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
                 tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    config = (Qwen3Config(**shape, head_dim=32) if family == "qwen3"
              else LlamaConfig(**shape, attention_bias=True, mlp_bias=True))
    write_fp8_checkpoint(folder, save_hf_model(folder, config), layout)
    if kv_scales:  # distinct per head, so a rank given the other's heads' scales would read its cache wrong
        tensors = load_file(str(folder / "model.safetensors"))
        for layer in range(shape["num_hidden_layers"]):
            tensors[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor([0.03, 0.05]) * (layer + 1)
            tensors[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor([0.02, 0.04])
        save_file(tensors, str(folder / "model.safetensors"))
    return f"hf-dir:{folder}", shape["vocab_size"]


# Per-token activations: a row-parallel rank scales its slice of a token by that slice's amax, not the whole
# row's, so TP=2 rounds those inputs differently; the logits then move by about what the FP8 cache itself moves
# them (0.006-0.009 here, of logits up to 0.8), within the bound below.
PER_TOKEN_ATOL = 0.03


@pytest.mark.parametrize(("family", "layout", "kv_scales", "atol"), [
    ("llama", "fp8-static", True, 1e-4), ("qwen3", "fp8-block", False, 1e-4), ("llama", "ct-channel", False,
                                                                               PER_TOKEN_ATOL)],
    ids=["llama-static-checkpoint-kv-scales", "qwen3-block-calibrated-kv-scales", "llama-per-token"])
def test_tp2_serves_an_fp8_checkpoint_with_an_fp8_cache_as_tp1_does(tmp_path, family, layout, kv_scales, atol):
    from metronome.contract.config import SchedulerConfig
    from metronome.server.engine.config import EngineConfig
    from metronome.server.engine.engine import EngineCore

    model, vocab = _checkpoint(tmp_path, family, layout, kv_scales)

    def engine(tp: int) -> EngineCore:
        config = EngineConfig(model=model, dtype="float32", device="cpu", attention_backend="torch", num_kv_blocks=64,
                              tensor_parallel_size=tp, kv_cache_dtype="fp8")
        return EngineCore.from_config(config, SchedulerConfig(chunk_size=16, long_chunk_size=16))

    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (7, 30, 45)]
    single = engine(1)
    expected_tokens, expected_logits = run_recording_logits(single, prompts, 12)
    assert single.kv_scales.source == ("checkpoint" if kv_scales else "calibrated")
    sharded = engine(2)
    try:
        cache = sharded.runner.kv_caches[0][0]
        assert cache.dtype == torch.float8_e4m3fn and cache.shape[2] == 1  # its own kv head, one byte a value
        # layer 0's K is the same on both (its input is the embedding): rank 0 holds its head's scale
        torch.testing.assert_close(sharded.kv_scales.k[0], single.kv_scales.k[0][:1], rtol=1e-5, atol=0)
        tokens, logits = run_recording_logits(sharded, prompts, 12)
    finally:
        sharded.close()
    assert_same_run(sharded, (tokens, logits), (expected_tokens, expected_logits), atol)
