"""Real model shapes for `random:<preset>` models (random weights): tests, demos and GPU benchmarks.

Importable without torch, so the operator and the CLI can list presets cheaply.
"""
from __future__ import annotations

import math
from typing import Any

from metronome.contract.errors import ModelNotFoundError
from metronome.server.models.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from metronome.server.models.moe_config import MoeSpec

_LLAMA3_8B: dict[str, Any] = dict(
    architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
    rope_scaling=None, max_position_embeddings=8192, tie_word_embeddings=False, attention_bias=False,
    bos_token_id=128000, eos_token_ids=(128001, 128009),
)

def _every_sixth_global(layers: int) -> tuple[str, ...]:
    """Gemma 3's pattern: five sliding-window layers, then one global."""
    return tuple(SLIDING_ATTENTION if (i + 1) % 6 else FULL_ATTENTION for i in range(layers))


def _qwen3(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, tie: bool) -> dict[str, Any]:
    return dict(architecture="qwen3", vocab_size=151936, hidden_size=hidden, intermediate_size=intermediate,
                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=128,
                rms_norm_eps=1e-6, rope_theta=1000000.0, rope_scaling=None, max_position_embeddings=40960,
                tie_word_embeddings=tie, attention_bias=False, qk_norm=True, bos_token_id=None,
                eos_token_ids=(151645, 151643))


def _gemma3(vocab: int, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, window: int,
            max_positions: int, rope_scaling: dict[str, Any] | None = None) -> dict[str, Any]:
    return dict(architecture="gemma3", vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=256,
                rms_norm_eps=1e-6, rope_theta=1000000.0, rope_scaling=rope_scaling, rope_local_theta=10000.0,
                max_position_embeddings=max_positions, tie_word_embeddings=True, attention_bias=False,
                hidden_act="gelu_tanh", qk_norm=True, norm_plus_one=True, sandwich_norm=True,
                embedding_scale=math.sqrt(hidden), query_pre_attn_scalar=256.0, sliding_window=window,
                layer_types=_every_sixth_global(layers), bos_token_id=2, eos_token_ids=(1, 106))


def _alternating_windows(layers: int) -> tuple[str, ...]:
    """gpt-oss's pattern: sliding-window and full layers taking turns, a window first."""
    return tuple(SLIDING_ATTENTION if i % 2 == 0 else FULL_ATTENTION for i in range(layers))


def _qwen_moe_spec(experts: int, top_k: int, size: int) -> MoeSpec:
    return MoeSpec(num_experts=experts, top_k=top_k, intermediate_size=size, weights_in_model_dtype=True)


def _gpt_oss_spec(experts: int, top_k: int, size: int) -> MoeSpec:
    return MoeSpec(num_experts=experts, top_k=top_k, intermediate_size=size, topk_before_softmax=True,
                   weights_in_model_dtype=True, router_bias=True, expert_bias=True, activation="swiglu_clamped",
                   checkpoint_layout="interleaved_transposed")


_GPT_OSS_YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096}

# Tiny shapes of each family for CPU tests: small enough to run in the Triton interpreter.
_TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None,
             max_position_embeddings=4096, tie_word_embeddings=False, attention_bias=False, bos_token_id=1,
             eos_token_ids=(2,))

PRESETS: dict[str, dict[str, Any]] = {
    # Small enough for CPU unit tests; context long enough for 2,000-token prompts.
    "tiny": dict(
        architecture="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
        rope_scaling=None, max_position_embeddings=4096, tie_word_embeddings=False, attention_bias=False,
        bos_token_id=1, eos_token_ids=(2,),
    ),
    "smollm2-135m": dict(
        architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
        rope_scaling=None, max_position_embeddings=8192, tie_word_embeddings=True, attention_bias=False,
        bos_token_id=1, eos_token_ids=(2,),
    ),
    "smollm2-360m": dict(
        architecture="llama", vocab_size=49152, hidden_size=960, intermediate_size=2560, num_hidden_layers=32,
        num_attention_heads=15, num_key_value_heads=5, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
        rope_scaling=None, max_position_embeddings=8192, tie_word_embeddings=True, attention_bias=False,
        bos_token_id=1, eos_token_ids=(2,),
    ),
    "llama-2-7b": dict(
        architecture="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, head_dim=128, rms_norm_eps=1e-5, rope_theta=10000.0,
        rope_scaling=None, max_position_embeddings=4096, tie_word_embeddings=False, attention_bias=False,
        bos_token_id=1, eos_token_ids=(2,),
    ),
    "llama-3-8b": _LLAMA3_8B,
    "llama-3.1-8b": {
        **_LLAMA3_8B,
        "max_position_embeddings": 131072,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        "eos_token_ids": (128001, 128008, 128009),
    },
    "llama-3-70b": {
        **_LLAMA3_8B, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
        "num_attention_heads": 64,
    },
    "mistral-7b": dict(
        architecture="mistral", vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=1000000.0,
        rope_scaling=None, max_position_embeddings=32768, tie_word_embeddings=False, attention_bias=False,
        bos_token_id=1, eos_token_ids=(2,),
    ),
    "qwen2-0.5b": dict(
        architecture="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-6, rope_theta=1000000.0,
        rope_scaling=None, max_position_embeddings=32768, tie_word_embeddings=True, attention_bias=True,
        bos_token_id=None, eos_token_ids=(151643, 151645),
    ),
    "qwen3-0.6b": _qwen3(1024, 3072, 28, 16, 8, tie=True),
    "qwen3-8b": _qwen3(4096, 12288, 36, 32, 8, tie=False),
    "gemma-3-270m": _gemma3(262144, 640, 2048, 18, 4, 1, window=512, max_positions=32768),
    "gemma-3-1b": _gemma3(262144, 1152, 6912, 26, 4, 1, window=512, max_positions=32768),
    "gemma-3-12b": _gemma3(262208, 3840, 15360, 48, 16, 8, window=1024, max_positions=131072,
                           rope_scaling={"rope_type": "linear", "factor": 8.0}),
    # Phi-4-mini's shapes; the LongRoPE factor sets have the right length (random weights: their values are
    # not the released model's).
    "phi-4-mini": dict(
        architecture="phi3", vocab_size=200064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
        num_attention_heads=24, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=10000.0,
        rope_scaling={"rope_type": "longrope", "original_max_position_embeddings": 4096,
                      "short_factor": [1.0] * 48, "long_factor": [1.0 + 0.7 * i for i in range(48)]},
        partial_rotary_factor=0.75, max_position_embeddings=131072, tie_word_embeddings=True,
        attention_bias=False, bos_token_id=199999, eos_token_ids=(199999, 200020),
    ),
    "tiny-qwen3": {**_TINY, "architecture": "qwen3", "qk_norm": True, "sliding_window": 48,
                   "layer_types": (FULL_ATTENTION, SLIDING_ATTENTION, SLIDING_ATTENTION)},
    "tiny-gemma3": {**_TINY, "architecture": "gemma3", "head_dim": 32, "hidden_act": "gelu_tanh", "qk_norm": True,
                    "norm_plus_one": True, "sandwich_norm": True, "embedding_scale": 8.0,
                    "query_pre_attn_scalar": 24.0, "sliding_window": 48, "rope_local_theta": 500.0,
                    "layer_types": (SLIDING_ATTENTION, FULL_ATTENTION, SLIDING_ATTENTION),
                    "tie_word_embeddings": True},
    "tiny-phi3": {**_TINY, "architecture": "phi3", "partial_rotary_factor": 0.75, "sliding_window": 64,
                  "rope_scaling": {"rope_type": "longrope", "original_max_position_embeddings": 256,
                                   "short_factor": [1.0 + 0.1 * i for i in range(6)],
                                   "long_factor": [2.0 + 0.5 * i for i in range(6)]}},
    # Mixtures of experts. Qwen3-30B-A3B: 128 experts of 768, 8 per token (3.3B of 30.5B parameters active).
    "qwen3-30b-a3b": {**_qwen3(2048, 6144, 48, 32, 4, tie=False), "architecture": "qwen3_moe",
                      "moe": _qwen_moe_spec(128, 8, 768)},
    # gpt-oss-20b: 32 experts of 2880, 4 per token; window-128 and full layers alternating, sinks, YaRN.
    "gpt-oss-20b": dict(
        architecture="gpt_oss", vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
        num_attention_heads=64, num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5, rope_theta=150000.0,
        rope_scaling=_GPT_OSS_YARN, max_position_embeddings=131072, tie_word_embeddings=False,
        attention_bias=True, attention_output_bias=True, sliding_window=128, layer_types=_alternating_windows(24),
        attention_sinks=True, norm_float_scale=True, moe=_gpt_oss_spec(32, 4, 2880), bos_token_id=199998,
        eos_token_ids=(200002, 199999, 200012),
    ),
    # Mixtral-8x7B: 8 experts of 14336, 2 per token, the weights kept in float32 (93 GB in bf16).
    "mixtral-8x7b": dict(
        architecture="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=1000000.0,
        rope_scaling=None, max_position_embeddings=32768, tie_word_embeddings=False, attention_bias=False,
        moe=MoeSpec(num_experts=8, top_k=2, intermediate_size=14336), bos_token_id=1, eos_token_ids=(2,),
    ),
    # Layer 1 dense (Qwen's mlp_only_layers), 8 experts of 64, top-2.
    "tiny-qwen3-moe": {**_TINY, "architecture": "qwen3_moe", "qk_norm": True, "moe": _qwen_moe_spec(8, 2, 64),
                       "moe_layers": (0, 2)},
    "tiny-mixtral": {**_TINY, "architecture": "mixtral", "moe": MoeSpec(num_experts=4, top_k=2, intermediate_size=64)},
    "tiny-gpt-oss": {**_TINY, "architecture": "gpt_oss", "attention_bias": True, "attention_output_bias": True,
                     "sliding_window": 48, "layer_types": _alternating_windows(3), "attention_sinks": True,
                     "norm_float_scale": True, "moe": _gpt_oss_spec(4, 2, 64),
                     "rope_scaling": {**_GPT_OSS_YARN, "factor": 4.0, "original_max_position_embeddings": 1024}},
    "qwen2-7b": dict(
        architecture="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
        rope_scaling=None, max_position_embeddings=32768, tie_word_embeddings=False, attention_bias=True,
        bos_token_id=None, eos_token_ids=(151643, 151645),
    ),
}


def preset_names() -> list[str]:
    return sorted(PRESETS)


def preset_config(name: str) -> ModelConfig:
    """The ModelConfig of a preset; ModelNotFoundError (listing the valid names) for anything else."""
    fields = PRESETS.get(name)
    if fields is None:
        raise ModelNotFoundError(f"unknown model preset {name!r}; valid presets: {', '.join(preset_names())}")
    return ModelConfig(**fields)
