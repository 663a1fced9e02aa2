"""The building blocks of a Llama decoder layer that do not touch the KV cache: RMSNorm and the SwiGLU MLP.

Each has two paths: the torch ops (the reference, and the CPU path) and, with `fused=True` (CUDA), one Triton
kernel for the element-wise part (kernels/triton_fused.py) that rounds where torch rounds.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """x / rms(x) * weight, normalised in float32 and cast back before the weight, as transformers does."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(input_dtype)

    def add_forward(self, delta: torch.Tensor | None, residual: torch.Tensor, fused: bool
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + delta), residual + delta); delta None: (norm(residual), residual). The fused kernel
        updates residual in place."""
        if fused:
            from metronome.kernels.triton_fused import add_rms_norm
            return add_rms_norm(delta, residual, self.weight, self.eps), residual
        if delta is not None:
            residual = residual + delta
        return self(residual), residual


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); gate and up share one matmul (`gate_up_proj`, gate rows first)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if fused:
            from metronome.kernels.triton_fused import silu_mul
            return self.down_proj(silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)
