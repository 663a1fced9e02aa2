"""Real model shapes for `random:<preset>` models (random weights): tests, demos and GPU benchmarks.

Importable without torch, so the operator and the CLI can list presets cheaply.
"""
from __future__ import annotations

from typing import Any

from metronome.contract.errors import ModelNotFoundError
from metronome.server.models.config import ModelConfig

_LLAMA3_8B: dict[str, Any] = dict(
    architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
    rope_scaling=None, max_position_embeddings=8192, tie_word_embeddings=False, attention_bias=False,
    bos_token_id=128000, eos_token_ids=(128001, 128009),
)

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
