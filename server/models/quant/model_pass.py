"""Model passes for FP8: swap the decoder's linear layers for `Fp8Linear`s (before weights load), and after
loading let the norms and the SiLU·mul that feed them hand over FP8 activations directly (fused kernels on CUDA).

Only the decoder layers' linears (`model.layers.N.…`) are swapped: the embeddings and the LM head stay in the
model dtype, as every FP8 checkpoint layout keeps them. A fused module (qkv_proj, gate_up_proj) takes its shard
sizes and checkpoint names from FUSED_SHARDS; the scheme's ignore list is matched against the checkpoint names,
and a fused module is quantised all or nothing.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from metronome.server.models.config import ModelConfig
from metronome.server.models.layers import GatedMLP, RMSNorm
from metronome.server.models.parallel_layers import Fp8RowParallelLinear
from metronome.server.models.quant.activation import ActivationQuant, Fp8Activation
from metronome.server.models.quant.fp8_linear import Fp8Linear
from metronome.server.models.quant.scheme import Fp8Scheme, QuantizationConfigError

DECODER_PREFIX = "model.layers."

# a mixture of experts' shared-expert gate ([1, H], one logit a token) stays in the model dtype, as MoE recipes
# keep it, except where a layout names exactly what it quantised (compressed-tensors' targets and ignore list,
# ModelOpt's exclude_modules): a recipe that does not exclude the gate quantises it (the router is no nn.Linear
# here; the routed experts have FP8 storage of their own: store_fp8_experts)
GATE_BY_CONVENTION = (".shared_expert_gate",)
EXPLICIT_LAYOUTS = ("compressed-tensors", "modelopt")

FP8_CONSUMERS = (Fp8Linear, Fp8RowParallelLinear)  # the linears whose producers may hand over FP8 activations

# our fused module → the checkpoint modules it stacks, in row order
FUSED_SHARDS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _shard_sizes(fused: str, config: ModelConfig, out_features: int) -> tuple[int, ...]:
    if fused == "qkv_proj":
        return config.q_size, config.kv_size, config.kv_size
    return out_features // 2, out_features // 2  # a dense MLP's, or a shared expert's own size


def swap_linears(model: nn.Module, config: ModelConfig, scheme: Fp8Scheme) -> int:
    """Replace the decoder's nn.Linear modules by empty Fp8Linear ones on the same device (meta before the
    weights are materialised); returns how many were swapped."""
    swapped = 0
    for name, module in list(model.named_modules()):
        if not name.startswith(DECODER_PREFIX):
            continue
        parent_name, _, attr = name.rpartition(".")
        fp8_replacement = getattr(module, "fp8_replacement", None)  # a layer that builds its own (tensor parallel)
        if fp8_replacement is not None:
            if not scheme.ignores(name):
                setattr(model.get_submodule(parent_name), attr, fp8_replacement(scheme, name))
                swapped += 1
            continue
        if type(module) is not nn.Linear:
            continue
        if name.endswith(GATE_BY_CONVENTION) and scheme.source not in EXPLICIT_LAYOUTS:
            continue
        parts = FUSED_SHARDS.get(attr)
        checkpoint_names = tuple(f"{parent_name}.{part}" for part in parts) if parts else (name,)
        ignored = [scheme.ignores(c) for c in checkpoint_names]
        if all(ignored):
            continue
        if any(ignored):
            raise QuantizationConfigError(f"quantization_config leaves some of {list(checkpoint_names)} unquantised "
                                          "but not all; this server multiplies them as one matrix")
        sizes = _shard_sizes(attr, config, module.out_features) if parts else (module.out_features,)
        layer = Fp8Linear(module.in_features, module.out_features, bias=module.bias is not None, scheme=scheme,
                          shard_sizes=sizes, dtype=module.weight.dtype, device=module.weight.device,
                          checkpoint_names=checkpoint_names)
        setattr(model.get_submodule(parent_name), attr, layer)
        swapped += 1
    return swapped


def store_fp8_experts(model: nn.Module, scheme: Fp8Scheme) -> int:
    """Give the routed experts of every MoE block that the checkpoint quantises FP8 storage (moe.py); returns how
    many blocks. On the fly (`--quantization fp8`) the experts load in the model dtype and are quantised after
    (quantize_loaded_experts)."""
    from metronome.server.models.moe import StackedExperts

    stored = 0
    for name, module in model.named_modules():
        if isinstance(module, StackedExperts) and not scheme.ignores(f"{name}.0.gate_proj"):
            module.store_fp8(scheme.block)
            stored += 1
    return stored


def quantize_loaded_experts(model: nn.Module) -> None:
    """`--quantization fp8`: the routed experts, loaded in the model dtype, to e4m3 per row."""
    from metronome.server.models.moe import StackedExperts

    for module in list(model.modules()):
        if isinstance(module, StackedExperts) and not module.fp8:
            module.quantize_loaded()


def fp8_layers(model: nn.Module) -> Iterator[tuple[str, Fp8Linear]]:
    for name, module in model.named_modules():
        if isinstance(module, Fp8Linear):
            yield name, module


# ---- fused producers ------------------------------------------------------------------------------------------

FUSABLE_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3")  # the pre-norm block (llama.py)


class Fp8OutputRMSNorm(RMSNorm):
    """An RMSNorm whose fused (CUDA) path quantises its output for the FP8 linear layer that reads it."""

    output_quant: ActivationQuant

    def add_forward(self, delta: torch.Tensor | None, residual: torch.Tensor, fused: bool
                    ) -> tuple[torch.Tensor | Fp8Activation, torch.Tensor]:
        if not fused:
            return super().add_forward(delta, residual, fused)
        from metronome.kernels.triton_fused import add_rms_norm_fp8

        how = self.output_quant
        q, scale = add_rms_norm_fp8(delta, residual, self.weight, self.eps, how.group, how.static_scale,
                                    amax_ub=how.amax_ub)
        return Fp8Activation(q, scale, residual.dtype, how.group), residual


class Fp8OutputGatedMLP(GatedMLP):
    """A SwiGLU MLP whose fused (CUDA) SiLU·mul quantises its output for the FP8 down projection."""

    output_quant: ActivationQuant

    def forward(self, x: torch.Tensor | Fp8Activation, fused: bool = False) -> torch.Tensor:
        if not fused:
            return super().forward(x, fused)
        from metronome.kernels.triton_fused import silu_mul_fp8

        gate_up = self.gate_up_proj(x)
        how = self.output_quant
        q, scale = silu_mul_fp8(gate_up, how.group, how.static_scale, amax_ub=how.amax_ub)
        return self.down_proj(Fp8Activation(q, scale, gate_up.dtype, how.group))


def fuse_activation_quant(model: nn.Module, config: ModelConfig) -> int:
    """After finalize: make each decoder layer's input norm, post-attention norm and MLP hand their FP8 consumer
    a quantised activation on the fused path (the class changes; parameters and names stay). Only the layer
    layouts known to feed exactly those linears are touched. Returns how many producers now quantise."""
    if config.architecture not in FUSABLE_ARCHITECTURES:
        return 0
    changed = 0
    for layer in model.model.layers:
        pairs = ((layer.input_layernorm, RMSNorm, Fp8OutputRMSNorm, layer.self_attn.qkv_proj),
                 (layer.post_attention_layernorm, RMSNorm, Fp8OutputRMSNorm, layer.mlp.gate_up_proj),
                 (layer.mlp, GatedMLP, Fp8OutputGatedMLP, layer.mlp.down_proj))
        for producer, base, fused_class, consumer in pairs:
            # the fused FP8 kernels are Llama's: weight x norm (not Gemma's 1 + weight), SiLU (not GELU)
            llama_style = not getattr(producer, "plus_one", False) and getattr(producer, "act", "silu") == "silu"
            if type(producer) is base and llama_style and isinstance(consumer, FP8_CONSUMERS):
                producer.__class__ = fused_class
                producer.output_quant = consumer.activation_quant
                changed += 1
    return changed
