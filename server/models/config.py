"""The shape of a Llama-family decoder, read from a Hugging Face `config.json`, GGUF metadata or a preset.

No torch here: the operator and the CLI may want model shapes without paying for torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from metronome.contract.errors import ModelNotFoundError

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class UnsupportedModelError(ModelNotFoundError):
    """The model exists and was read, but it needs a feature this decoder does not implement."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # "llama" | "mistral" | "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    # None for plain rope; else {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    # "original_max_position_embeddings"} or {"rope_type": "linear", "factor"}.
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on the q, k, v projections (Qwen2; Llama when config.attention_bias)
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    attention_output_bias: bool = False  # bias on o_proj (Llama's attention_bias covers o_proj too; Qwen2's not)
    mlp_bias: bool = False
    notes: tuple[str, ...] = field(default=(), compare=False)  # what the loader adapted, for logs and reports

    def __post_init__(self) -> None:
        validate(self)

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def num_parameters(self) -> int:
        """Parameter count (embedding counted once when tied); handy for memory planning without building."""
        h, layers = self.hidden_size, self.num_hidden_layers
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.attention_bias:
            attn += self.q_size + 2 * self.kv_size
        if self.attention_output_bias:
            attn += h
        mlp = 3 * h * self.intermediate_size + (2 * self.intermediate_size + h if self.mlp_bias else 0)
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return layers * (attn + mlp + 2 * h) + h + embeddings


def validate(config: ModelConfig) -> None:
    """Reject shapes this decoder cannot run, with a message that says which field is wrong."""
    if config.architecture not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"unsupported architecture {config.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    positive = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings")
    for name in positive:
        value = getattr(config, name)
        if not isinstance(value, int) or value <= 0:
            raise UnsupportedModelError(f"model config field {name} must be a positive integer, got {value!r}")
    if config.num_attention_heads % config.num_key_value_heads:
        raise UnsupportedModelError(
            f"num_attention_heads ({config.num_attention_heads}) must be a multiple of "
            f"num_key_value_heads ({config.num_key_value_heads})"
        )
    if config.head_dim % 2:
        raise UnsupportedModelError(f"head_dim must be even for rotary embeddings, got {config.head_dim}")
    if not config.rope_theta > 0 or not config.rms_norm_eps > 0:
        raise UnsupportedModelError("rope_theta and rms_norm_eps must be positive")
    if config.rope_scaling is not None:
        rope_type = config.rope_scaling.get("rope_type")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"unsupported rope scaling {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        required = {"linear": ("factor",),
                    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
        for key in required.get(rope_type, ()):
            if key not in config.rope_scaling:
                raise UnsupportedModelError(f"rope scaling {rope_type!r} needs {key!r}")


def normalize_rope_scaling(raw: dict[str, Any] | None) -> dict[str, Any] | None:
    """Bring the rope_scaling / rope_parameters dict of any transformers version to one form (None = plain)."""
    if not raw:
        return None
    scaling = {k: v for k, v in raw.items() if k not in ("rope_theta", "type")}
    scaling["rope_type"] = raw.get("rope_type") or raw.get("type") or "default"
    if scaling["rope_type"] == "default":
        return None
    return scaling


def _eos_tuple(*values: Any) -> tuple[int, ...]:
    """Merge eos ids given as int, list or None, keeping first-seen order."""
    ids: list[int] = []
    for value in values:
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(item, int) and item >= 0 and item not in ids:
                ids.append(item)
    return tuple(ids)


def config_from_hf_dict(raw: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelConfig:
    """A Hugging Face `config.json` (+ optional `generation_config.json`) → ModelConfig.

    Handles both the classic keys (`rope_theta`, `rope_scaling`) and transformers 5's `rope_parameters`.
    """
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    hidden_act = raw.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise UnsupportedModelError(f"unsupported hidden_act {hidden_act!r}; only silu (SwiGLU) is implemented")
    try:
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        rope_params = raw.get("rope_parameters") or {}
        rope_theta = float(rope_params.get("rope_theta", raw.get("rope_theta", 10000.0)))
        rope_scaling = normalize_rope_scaling(raw.get("rope_scaling") or rope_params)
        max_positions = int(raw.get("max_position_embeddings", 2048))
        notes: list[str] = []
        window = _sliding_window(raw)
        if window is not None and window < max_positions:
            # Sliding-window attention is not implemented: serve only contexts that fit in the window, where
            # full causal attention and sliding-window attention are the same computation.
            notes.append(f"sliding_window={window}: context capped from {max_positions} to {window}")
            max_positions = window
        qwen = model_type == "qwen2"
        generation = generation or {}
        return ModelConfig(
            architecture=model_type,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=True if qwen else bool(raw.get("attention_bias", False)),
            attention_output_bias=False if qwen else bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            bos_token_id=generation.get("bos_token_id", raw.get("bos_token_id")),
            eos_token_ids=_eos_tuple(generation.get("eos_token_id"), raw.get("eos_token_id")),
            notes=tuple(notes),
        )
    except KeyError as missing:
        raise ModelNotFoundError(f"config.json lacks the field {missing.args[0]!r}") from None
    except (TypeError, ValueError) as bad:
        if isinstance(bad, ModelNotFoundError):
            raise
        raise ModelNotFoundError(f"config.json has a malformed field: {bad}") from None


def _sliding_window(raw: dict[str, Any]) -> int | None:
    """The window a config asks for, or None (Qwen2 carries a window but turns it off with use_sliding_window)."""
    if raw.get("model_type") == "qwen2" and not raw.get("use_sliding_window", False):
        return None
    window = raw.get("sliding_window")
    return int(window) if window else None
