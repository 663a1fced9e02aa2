"""The shape and the rules of a mixture-of-experts block, read from a Hugging Face `config.json`.

One `MoeSpec` says everything a family's MoE block differs in: how many experts and how many a token picks, how the
router turns logits into weights (and in which dtype those weights reach the experts, which decides bf16 rounding),
the experts' activation and biases, a shared expert, and how the checkpoint lays the expert matrices out. No torch
here: presets, the CLI and the benchmark's floor arithmetic read it without paying for torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from metronome.server.models.config import UnsupportedModelError

# How the routed experts run (server/models/moe.py): auto = triton where the model runs its fused CUDA kernels,
# else the reference loop; triton = the fused kernels; grouped_mm = torch's grouped GEMM; reference = a loop over
# the experts (exact, reads the routing on the host: no CUDA graphs).
MOE_BACKENDS = ("auto", "triton", "grouped_mm", "reference")
SCORINGS = ("softmax", "sigmoid")
ACTIVATIONS = ("silu", "swiglu_clamped")
# "concatenated": [E, 2I, H] gate rows then up rows, or one tensor per expert (transformers 5 and the Hub files);
# "interleaved_transposed": gpt-oss's [E, H, 2I] with gate and up in alternating columns.
CHECKPOINT_LAYOUTS = ("concatenated", "interleaved_transposed")


@dataclass(frozen=True)
class MoeSpec:
    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    scoring: str = "softmax"  # softmax over all experts, or a sigmoid per expert (DeepSeek-V3 style)
    # gpt-oss: pick the top-k logits first, then softmax over those k (in the model dtype).
    topk_before_softmax: bool = False
    renormalize: bool = True  # divide the chosen weights by their sum
    # Qwen casts the routing weights to the model dtype before they scale an expert's output; Mixtral and
    # DeepSeek keep them float32 (the product is rounded once, not twice).
    weights_in_model_dtype: bool = False
    router_bias: bool = False  # gpt-oss: a bias on the router's linear layer
    router_in_float32: bool = False  # DeepSeek: the router matmul in float32
    score_correction_bias: bool = False  # DeepSeek: a per-expert bias that steers the choice, not the weight
    num_groups: int = 1  # DeepSeek: experts in groups, of which topk_groups are kept before the top-k
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    expert_bias: bool = False  # gpt-oss: biases on both expert projections
    activation: str = "silu"
    swiglu_alpha: float = 1.702  # swiglu_clamped: (clamp(up) + 1) * gate * sigmoid(alpha * gate), gate <= limit
    swiglu_limit: float = 7.0
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: a dense expert every token also runs (0 = none)
    shared_expert_gate: bool = False  # ... scaled by sigmoid(a linear gate of the token)
    checkpoint_layout: str = "concatenated"

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "intermediate_size", "num_groups", "topk_groups"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise UnsupportedModelError(f"MoE field {name} must be a positive integer, got {value!r}")
        if self.top_k > self.num_experts:
            raise UnsupportedModelError(f"MoE top_k ({self.top_k}) exceeds num_experts ({self.num_experts})")
        if self.scoring not in SCORINGS:
            raise UnsupportedModelError(f"MoE scoring {self.scoring!r}; supported: {', '.join(SCORINGS)}")
        if self.activation not in ACTIVATIONS:
            raise UnsupportedModelError(f"MoE activation {self.activation!r}; supported: {', '.join(ACTIVATIONS)}")
        if self.checkpoint_layout not in CHECKPOINT_LAYOUTS:
            raise UnsupportedModelError(f"MoE checkpoint layout {self.checkpoint_layout!r}")
        if self.num_experts % self.num_groups or self.topk_groups > self.num_groups:
            raise UnsupportedModelError(f"MoE groups: {self.num_experts} experts cannot form {self.num_groups} "
                                        f"groups of which {self.topk_groups} are kept")
        if self.scoring == "sigmoid" and self.topk_before_softmax:
            raise UnsupportedModelError("MoE topk_before_softmax applies to softmax scoring only")
        if self.num_groups > 1 and self.num_experts // self.num_groups < 2:
            raise UnsupportedModelError("MoE groups need at least 2 experts each (a group scores its top two)")
        if self.shared_expert_intermediate_size < 0:
            raise UnsupportedModelError("MoE shared_expert_intermediate_size must be >= 0")
        if self.shared_expert_gate and not self.shared_expert_intermediate_size:
            raise UnsupportedModelError("MoE shared_expert_gate needs a shared expert")

    @property
    def has_shared_expert(self) -> bool:
        return self.shared_expert_intermediate_size > 0

    def expert_parameters(self, hidden_size: int) -> int:
        """Parameters of one routed expert (gate, up and down matrices, and their biases)."""
        biases = (2 * self.intermediate_size + hidden_size) if self.expert_bias else 0
        return 3 * hidden_size * self.intermediate_size + biases

    def block_parameters(self, hidden_size: int) -> int:
        """Parameters of the whole block: router, every expert, the shared expert and its gate."""
        router = self.num_experts * hidden_size + (self.num_experts if self.router_bias else 0)
        shared = 3 * hidden_size * self.shared_expert_intermediate_size + (hidden_size if self.shared_expert_gate
                                                                           else 0)
        return router + self.num_experts * self.expert_parameters(hidden_size) + shared


def expected_distinct_experts(num_experts: int, top_k: int, tokens: float) -> float:
    """How many experts a step of `tokens` tokens reads under uniform routing: a token leaves a given expert out
    with probability 1 - k/E, independently of the others, so E·(1 - (1 - k/E)^T). One token reads k, a large
    batch all E: the weight bytes of an MoE decode step grow with the batch until every expert is read."""
    if tokens <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


MOE_MODEL_TYPES = ("qwen2_moe", "qwen3_moe", "mixtral", "gpt_oss")


def moe_spec_from_hf(raw: dict[str, Any]) -> MoeSpec:
    """The MoE block of a `config.json` of one of MOE_MODEL_TYPES (KeyError for a missing field: the caller names
    the file)."""
    model_type = raw.get("model_type")
    num_experts = int(raw.get("num_experts") or raw["num_local_experts"])
    top_k = int(raw["num_experts_per_tok"])
    if model_type in ("qwen2_moe", "qwen3_moe"):
        shared = int(raw.get("shared_expert_intermediate_size") or 0) if model_type == "qwen2_moe" else 0
        return MoeSpec(num_experts=num_experts, top_k=top_k, intermediate_size=int(raw["moe_intermediate_size"]),
                       renormalize=bool(raw.get("norm_topk_prob", False)), weights_in_model_dtype=True,
                       shared_expert_intermediate_size=shared, shared_expert_gate=shared > 0)
    if model_type == "mixtral":
        return MoeSpec(num_experts=num_experts, top_k=top_k, intermediate_size=int(raw["intermediate_size"]))
    if model_type == "gpt_oss":
        return MoeSpec(num_experts=num_experts, top_k=top_k, intermediate_size=int(raw["intermediate_size"]),
                       topk_before_softmax=True, weights_in_model_dtype=True, router_bias=True,
                       expert_bias=True, activation="swiglu_clamped",
                       swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
                       swiglu_limit=float(raw.get("swiglu_limit", 7.0)),
                       checkpoint_layout="interleaved_transposed")
    raise UnsupportedModelError(f"model_type {model_type!r} has no MoE block; MoE types: {', '.join(MOE_MODEL_TYPES)}")


def moe_layer_indices(raw: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    """Which decoder layers carry the MoE block (the others a dense MLP): Qwen's `decoder_sparse_step` and
    `mlp_only_layers`; every layer for Mixtral and gpt-oss."""
    if raw.get("model_type") not in ("qwen2_moe", "qwen3_moe"):
        return tuple(range(num_layers))
    step = int(raw.get("decoder_sparse_step") or 1)
    dense = {int(i) for i in raw.get("mlp_only_layers") or ()}
    return tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
