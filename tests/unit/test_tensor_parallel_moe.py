"""Mixtures of experts under tensor parallelism: every expert's MLP split as a dense MLP is (gate and up rows,
down columns) in each checkpoint layout (one tensor per expert under Qwen's and Mixtral's names, stacked, stacked
per projection, FP8 with per-row or block scales), and an engine at TP=2 over gloo giving TP=1's tokens and logits:
Qwen3-MoE with a dense layer beside its expert layers, Qwen2-MoE with its gated shared expert, and an FP8
Qwen3-MoE checkpoint with an FP8 KV cache.

Each rank's experts give partial sums that one all-reduce adds up after the block; the router is whole on every
rank. FP8 experts run on unquantised activations (W8A16), so with the attention's linears in a block layout TP=2
does TP=1's math and the logits differ by summation order only.
"""
from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from fp8_checkpoints import BLOCK, dequantize_weight, quantize_weight
from safetensors.torch import load_file, save_file
from test_loaders import save_hf_model
from test_tensor_parallel import assert_same_run, one_thread_per_rank, run_recording_logits  # noqa: F401 (a fixture)

from metronome.contract.errors import InvalidRequestError
from metronome.server.models.moe_config import MoeSpec
from metronome.server.models.parallel import plan_shards, shard_for
from metronome.server.models.presets import preset_config

EXPERTS, EXPERT_WIDTH, HIDDEN = 4, 64, 128
CONFIG = replace(preset_config("tiny-qwen3-moe"), hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=32, moe=MoeSpec(num_experts=EXPERTS, top_k=2, intermediate_size=EXPERT_WIDTH,
                                          shared_expert_intermediate_size=128, shared_expert_gate=True))


def _weights(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)))


@pytest.mark.parametrize("granularity", [None, "channel", "block"])
@pytest.mark.parametrize("name", ["model.layers.0.mlp.experts.2.gate_proj", "model.layers.0.mlp.experts.2.down_proj",
                                  "model.layers.0.block_sparse_moe.experts.1.w3",
                                  "model.layers.0.block_sparse_moe.experts.1.w2",
                                  "model.layers.0.mlp.shared_expert.up_proj",
                                  "model.layers.0.mlp.shared_expert.down_proj"])
def test_each_ranks_part_of_an_expert_is_its_slice_of_the_mlp(name, granularity):
    plan = plan_shards(CONFIG, 2)
    width = 128 if "shared" in name else EXPERT_WIDTH
    down = name.endswith(("down_proj", "w2"))
    weight = _weights(HIDDEN, width) if down else _weights(width, HIDDEN)
    block = BLOCK if granularity == "block" else None
    parts = []
    for rank in range(2):
        if granularity is None:
            parts.append(shard_for(f"{name}.weight", weight, plan, rank))
            continue
        q, scale = quantize_weight(weight, granularity)
        q_part = shard_for(f"{name}.weight", q, plan, rank, block)
        scale_part = shard_for(f"{name}.weight_scale", scale, plan, rank, block)
        parts.append(dequantize_weight(q_part, scale_part, granularity))
    full = weight if granularity is None else dequantize_weight(*quantize_weight(weight, granularity), granularity)
    assert torch.equal(torch.cat(parts, dim=1 if down else 0), full)


def test_stacked_experts_are_cut_per_expert():
    plan = plan_shards(CONFIG, 2)
    gate_up = _weights(EXPERTS, 2 * EXPERT_WIDTH, HIDDEN)  # gate rows, then up rows
    down = _weights(EXPERTS, HIDDEN, EXPERT_WIDTH)
    prefix = "model.layers.0.mlp.experts."
    halves = [shard_for(prefix + "gate_up_proj", gate_up, plan, r) for r in range(2)]
    gate, up = gate_up.chunk(2, dim=1)
    assert torch.equal(torch.cat([h.chunk(2, dim=1)[0] for h in halves], dim=1), gate)
    assert torch.equal(torch.cat([h.chunk(2, dim=1)[1] for h in halves], dim=1), up)
    assert torch.equal(torch.cat([shard_for(prefix + "down_proj", down, plan, r) for r in range(2)], dim=2), down)
    per_projection = gate.contiguous()  # GGUF: [E, I, H] per projection
    assert torch.equal(torch.cat([shard_for(prefix + "gate_proj.weight", per_projection, plan, r)
                                  for r in range(2)], dim=1), per_projection)
    assert torch.equal(torch.cat([shard_for(prefix + "down_proj.weight", down, plan, r) for r in range(2)], dim=2),
                       down)
    router = _weights(EXPERTS, HIDDEN)
    assert shard_for("model.layers.0.mlp.gate.weight", router, plan, 1) is router  # every rank routes alike


def test_an_expert_width_the_size_does_not_divide_is_refused():
    with pytest.raises(InvalidRequestError, match="does not divide an expert's MLP width 64") as refused:
        plan_shards(replace(CONFIG, num_attention_heads=6, num_key_value_heads=6, head_dim=16, intermediate_size=96), 3)
    assert refused.value.param == "tensor_parallel_size"


def _qwen3_moe(folder):
    from transformers import Qwen3MoeConfig

    # layer 1 keeps a dense MLP (mlp_only_layers), the others route to 2 of 4 experts
    config = Qwen3MoeConfig(vocab_size=333, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=3,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                            rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                            moe_intermediate_size=EXPERT_WIDTH, num_experts=EXPERTS, num_experts_per_tok=2,
                            norm_topk_prob=True, mlp_only_layers=[1])
    return save_hf_model(folder, config)


def _qwen2_moe(folder):
    from transformers import Qwen2MoeConfig

    # layer 1 sparse (decoder_sparse_step 2) with a gated shared expert, top-3 not renormalised
    config = Qwen2MoeConfig(vocab_size=333, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=3,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                            rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                            moe_intermediate_size=EXPERT_WIDTH, shared_expert_intermediate_size=96,
                            num_experts=EXPERTS, num_experts_per_tok=3, decoder_sparse_step=2)
    return save_hf_model(folder, config)


def _fp8_qwen3_moe(folder):
    from test_fp8_moe import _write_fp8_moe

    _write_fp8_moe(folder, _qwen3_moe(folder), "fp8-block")  # the experts FP8 too, one tensor each


def _gpt_oss(folder):
    from transformers import GptOssConfig

    # window and full layers alternating, sinks, q/k/v/o and expert biases; experts stored [E, H, 2I] with gate and
    # up alternating, as gpt-oss's bf16 checkpoints hold them
    config = GptOssConfig(vocab_size=333, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=3,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                          rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                          sliding_window=20, num_local_experts=EXPERTS, num_experts_per_tok=2,
                          layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    model = save_hf_model(folder, config)
    tensors = load_file(folder / "model.safetensors")
    generator = torch.Generator().manual_seed(5)
    for name, value in tensors.items():  # the experts' biases and the sinks start at 0: make them count
        if name.endswith(("_bias", ".sinks")):
            value.add_(torch.randn(value.shape, generator=generator) * 0.1)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return model


def _gpt_oss_mxfp4(folder):
    """gpt-oss with its experts as the Hub ships them: MXFP4 `_blocks` (16 bytes = 32 values) and `_scales`."""
    config = _gpt_oss(folder).config
    generator = torch.Generator().manual_seed(11)
    tensors = load_file(folder / "model.safetensors")
    for layer in range(config.num_hidden_layers):
        for proj, rows, columns in (("gate_up_proj", 2 * config.intermediate_size, HIDDEN),
                                    ("down_proj", HIDDEN, config.intermediate_size)):
            name = f"model.layers.{layer}.mlp.experts.{proj}"
            del tensors[name]
            tensors[f"{name}_blocks"] = torch.randint(0, 256, (EXPERTS, rows, columns // 32, 16), generator=generator,
                                                      dtype=torch.uint8)
            tensors[f"{name}_scales"] = torch.randint(118, 124, (EXPERTS, rows, columns // 32), generator=generator,
                                                      dtype=torch.uint8)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize(("write", "kv_cache_dtype"), [(_qwen3_moe, "auto"), (_qwen2_moe, "auto"),
                                                      (_fp8_qwen3_moe, "fp8"), (_gpt_oss, "auto"),
                                                      (_gpt_oss_mxfp4, "fp8")],
                         ids=["qwen3-moe", "qwen2-moe-shared-expert", "qwen3-moe-fp8-block-fp8-cache", "gpt-oss",
                              "gpt-oss-mxfp4-fp8-cache"])
def test_tp2_serves_a_mixture_of_experts_as_tp1_does(tmp_path, write, kv_cache_dtype):
    from metronome.contract.config import SchedulerConfig
    from metronome.server.engine.config import EngineConfig
    from metronome.server.engine.engine import EngineCore

    write(tmp_path)

    def engine(tp: int) -> EngineCore:
        config = EngineConfig(model=f"hf-dir:{tmp_path}", dtype="float32", device="cpu", attention_backend="torch",
                              num_kv_blocks=64, tensor_parallel_size=tp, kv_cache_dtype=kv_cache_dtype)
        return EngineCore.from_config(config, SchedulerConfig(chunk_size=16, long_chunk_size=16))

    rng = random.Random(1)
    prompts = [[rng.randrange(3, 333) for _ in range(n)] for n in (6, 29, 44)]
    expected = run_recording_logits(engine(1), prompts, 12)
    sharded = engine(2)
    try:
        block = next(layer.mlp for layer in sharded.runner.model.model.layers if hasattr(layer.mlp, "experts"))
        width = sharded.loaded.config.moe.intermediate_size
        assert block.experts.down_proj.shape == (EXPERTS, HIDDEN, width // 2)  # half of every expert
        assert block.experts.fp8 == (write is _fp8_qwen3_moe)
        run = run_recording_logits(sharded, prompts, 12)
    finally:
        sharded.close()
    assert_same_run(sharded, run, expected, atol=1e-4)
