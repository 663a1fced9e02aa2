"""The building blocks of a decoder layer that do not touch the KV cache: RMSNorm and the gated MLP, and the
`ModelParts` a family builds its layers from.

Each block has two paths: the torch ops (the reference, and the CPU path) and, with `fused=True` (CUDA), one
Triton kernel for the element-wise part (kernels/triton_fused.py) that rounds where torch rounds.

`ModelParts` is how a family asks for its linear layers and its MLP: a quantised linear (FP8) or a mixture of
experts replaces the default there, once, for every family.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from metronome.server.models.config import ModelConfig


class RMSNorm(nn.Module):
    """x / rms(x) scaled by weight, normalised in float32. Llama style: cast back to the model dtype, then times
    weight. Gemma style (plus_one): times (1 + weight) in float32, then cast once. gpt-oss style (float_scale):
    times weight in float32, then cast once."""

    def __init__(self, hidden_size: int, eps: float, plus_one: bool = False, float_scale: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.plus_one = plus_one
        self.float_scale = float_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.plus_one:
            return (x32 * (1.0 + self.weight.float())).to(input_dtype)
        if self.float_scale:
            return (self.weight.float() * x32).to(input_dtype)
        return self.weight * x32.to(input_dtype)

    def add_forward(self, delta: torch.Tensor | None, residual: torch.Tensor, fused: bool
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + delta), residual + delta); delta None: (norm(residual), residual). The fused kernel
        updates residual in place."""
        if fused:
            from metronome.kernels.triton_fused import add_rms_norm
            return add_rms_norm(delta, residual, self.weight, self.eps, plus_one=self.plus_one,
                                float_scale=self.float_scale), residual
        if delta is not None:
            residual = residual + delta
        return self(residual), residual

    def norm(self, x: torch.Tensor, fused: bool) -> torch.Tensor:
        """norm(x) of [T, N] rows (no residual)."""
        if fused:
            from metronome.kernels.triton_fused import rms_norm
            return rms_norm(x, self.weight, self.eps, plus_one=self.plus_one, float_scale=self.float_scale)
        return self(x)


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)); gate and up share one matmul (`gate_up_proj`, gate rows first). act: SiLU
    (SwiGLU) or tanh-approximated GELU (GeGLU)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, act: str = "silu",
                 linear: Callable[..., nn.Module] = nn.Linear):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.act = act
        self.gate_up_proj = linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if fused:
            from metronome.kernels.triton_fused import gated_act
            return self.down_proj(gated_act(gate_up, self.act))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(_ACTIVATIONS[self.act](gate) * up)


def dense_mlp(config: ModelConfig, layer: int, linear: Callable[..., nn.Module]) -> nn.Module:
    return GatedMLP(config.hidden_size, config.intermediate_size, config.mlp_bias, config.hidden_act, linear)


@dataclass(frozen=True)
class ModelParts:
    """What a family builds its layers from. linear(in_features, out_features, bias=...) makes every projection
    of the layers (not the embedding or the LM head); mlp(config, layer index, linear) makes a layer's MLP, any
    module with forward(x, fused) -> [T, hidden]."""

    linear: Callable[..., nn.Module] = nn.Linear
    mlp: Callable[[ModelConfig, int, Callable[..., nn.Module]], nn.Module] = dense_mlp
