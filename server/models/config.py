"""The shape of a decoder (Llama, Mistral, Qwen2, Qwen3, Gemma 3, Phi-3, and the mixtures of experts Qwen2-MoE,
Qwen3-MoE, Mixtral, gpt-oss), read from a Hugging Face `config.json` (hf_config.py), GGUF metadata
(gguf_loader.py) or a preset.

One dataclass for every family: the family picks the block (`architecture`), and the per-layer attention options
(sliding windows, QK-norm, rope bases, softcapping, sinks) are fields here, so an attention call gets them as
parameters. An MoE model carries its expert block's spec (`moe`, moe_config.MoeSpec) and which layers have it.
No torch here: the operator and the CLI may want model shapes without paying for torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from metronome.contract.errors import ModelNotFoundError

if TYPE_CHECKING:
    from metronome.server.models.moe_config import MoeSpec

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma3", "phi3", "qwen2_moe", "qwen3_moe",
                           "mixtral", "gpt_oss")
MOE_ARCHITECTURES = ("qwen2_moe", "qwen3_moe", "mixtral", "gpt_oss")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")
HIDDEN_ACTS = ("silu", "gelu_tanh")
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"


class UnsupportedModelError(ModelNotFoundError):
    """The model exists and was read, but it needs a feature this decoder does not implement."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # one of SUPPORTED_ARCHITECTURES: which block the layers are
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
    # "original_max_position_embeddings"}, {"rope_type": "linear", "factor"} or {"rope_type": "longrope",
    # "short_factor", "long_factor", "original_max_position_embeddings", optional "factor", "attention_factor"}.
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on the q, k, v projections (Qwen2; Llama when config.attention_bias)
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    attention_output_bias: bool = False  # bias on o_proj (Llama's attention_bias covers o_proj too; Qwen2's not)
    mlp_bias: bool = False
    hidden_act: str = "silu"  # the gate's activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, Gemma)
    qk_norm: bool = False  # per-head RMSNorm of q and k before rope (Qwen3, Gemma 3)
    norm_plus_one: bool = False  # RMSNorm scales by (1 + weight), in float32 (Gemma)
    sandwich_norm: bool = False  # norms after attention and after the MLP as well as before (Gemma 3)
    embedding_scale: float | None = None  # embeddings multiplied by this, in the model dtype (Gemma: sqrt(hidden))
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 (default head_dim ** -0.5)
    attn_logit_softcapping: float | None = None  # scores -> cap * tanh(scores / cap)
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap)
    sliding_window: int | None = None  # keys a query of a sliding layer sees, itself included
    layer_types: tuple[str, ...] | None = None  # per layer FULL_ or SLIDING_ATTENTION; None: all sliding if a window
    rope_local_theta: float | None = None  # rope base of the sliding layers, which use plain rope (Gemma 3)
    partial_rotary_factor: float = 1.0  # rope turns the first head_dim * this dims only (Phi-4-mini)
    norm_float_scale: bool = False  # RMSNorm scales by weight in float32 and casts once (gpt-oss)
    attention_sinks: bool = False  # a learned logit per head in every softmax's denominator (gpt-oss)
    moe: MoeSpec | None = None  # the expert block of the MoE layers (None: a dense model)
    moe_layers: tuple[int, ...] | None = None  # the layers with the expert block (None: all, when moe is set)
    notes: tuple[str, ...] = field(default=(), compare=False)  # what the loader adapted, for logs and reports

    def __post_init__(self) -> None:
        validate(self)

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of a layer, or None for full attention."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None or self.layer_types[layer] == SLIDING_ATTENTION:
            return self.sliding_window
        return None

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        return tuple(self.layer_window(i) for i in range(self.num_hidden_layers))

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and (self.moe_layers is None or layer in self.moe_layers)

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_hidden_layers))

    def num_parameters(self) -> int:
        """Parameter count (embedding counted once when tied); handy for memory planning without building."""
        h, layers = self.hidden_size, self.num_hidden_layers
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.attention_bias:
            attn += self.q_size + 2 * self.kv_size
        if self.attention_output_bias:
            attn += h
        if self.qk_norm:
            attn += 2 * self.head_dim
        if self.attention_sinks:
            attn += self.num_attention_heads
        mlp = 3 * h * self.intermediate_size + (2 * self.intermediate_size + h if self.mlp_bias else 0)
        norms = (4 if self.sandwich_norm else 2) * h
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        sparse = self.num_moe_layers
        moe = sparse * self.moe.block_parameters(h) if self.moe is not None else 0
        return layers * (attn + norms) + (layers - sparse) * mlp + moe + h + embeddings


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
    if config.rotary_dim % 2 or not 0 < config.rotary_dim <= config.head_dim:
        raise UnsupportedModelError(f"the rotary dims (head_dim {config.head_dim} x partial_rotary_factor "
                                    f"{config.partial_rotary_factor}) must be even and at most head_dim")
    if not config.rope_theta > 0 or not config.rms_norm_eps > 0:
        raise UnsupportedModelError("rope_theta and rms_norm_eps must be positive")
    if config.hidden_act not in HIDDEN_ACTS:
        raise UnsupportedModelError(f"unsupported hidden_act {config.hidden_act!r}; supported: silu, "
                                    "gelu_pytorch_tanh")
    if config.sliding_window is not None and (not isinstance(config.sliding_window, int) or config.sliding_window < 1):
        raise UnsupportedModelError(f"sliding_window must be a positive integer, got {config.sliding_window!r}")
    if config.layer_types is not None:
        if len(config.layer_types) != config.num_hidden_layers:
            raise UnsupportedModelError(f"layer_types has {len(config.layer_types)} entries for "
                                        f"{config.num_hidden_layers} layers")
        unknown = set(config.layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION}
        if unknown:
            raise UnsupportedModelError(f"unsupported layer types {sorted(unknown)}; supported: {FULL_ATTENTION}, "
                                        f"{SLIDING_ATTENTION}")
    for name in ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar", "embedding_scale"):
        value = getattr(config, name)
        if value is not None and not value > 0:
            raise UnsupportedModelError(f"{name} must be positive when set, got {value!r}")
    if config.rope_scaling is not None:
        _validate_rope_scaling(config)
    if config.architecture in MOE_ARCHITECTURES and config.moe is None:
        raise UnsupportedModelError(f"architecture {config.architecture!r} needs its MoE block (moe)")
    if config.moe_layers is not None:
        if config.moe is None:
            raise UnsupportedModelError("moe_layers is set but the model has no MoE block")
        outside = [i for i in config.moe_layers if not 0 <= i < config.num_hidden_layers]
        if outside:
            raise UnsupportedModelError(f"moe_layers {outside} are not layers of a {config.num_hidden_layers}-layer "
                                        "model")


def _validate_rope_scaling(config: ModelConfig) -> None:
    scaling = config.rope_scaling
    rope_type = scaling.get("rope_type")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"unsupported rope scaling {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    required = {"linear": ("factor",),
                "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
                "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
                "yarn": ("factor", "original_max_position_embeddings")}
    for key in required.get(rope_type, ()):
        if key not in scaling:
            raise UnsupportedModelError(f"rope scaling {rope_type!r} needs {key!r}")
    if rope_type == "longrope":
        for key in ("short_factor", "long_factor"):
            if len(scaling[key]) != config.rotary_dim // 2:
                raise UnsupportedModelError(f"longrope {key} has {len(scaling[key])} entries, expected "
                                            f"{config.rotary_dim // 2} (rotary dims / 2)")
