"""What a norm or an MLP hands its FP8 linear layer at the smallest decode batches: not its output but the inputs
it would make it from, for the weight-only GEMM to make it as it streams (kernels/triton_w8a16.py). A layer of
Llama then launches its four GEMMs, rope with the KV write, and the attention, and no norm, SiLU·mul or
quantiser kernels in between.

`unquantised_rows` (quant/cuda_gemm.py) says up to how many rows a layer takes these; each producer holds its
consumer's answer from the model pass on (quant/model_pass.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class NormedInput:
    """rms_norm(residual + delta) times `weight` (Llama's RMSNorm); the GEMM writes residual + delta to
    `new_residual` (the residual itself when delta is None: nothing to write)."""

    delta: torch.Tensor | None
    residual: torch.Tensor
    weight: torch.Tensor
    eps: float
    new_residual: torch.Tensor

    @property
    def rows(self) -> int:
        return self.residual.shape[0]


@dataclass(frozen=True)
class SiluMulInput:
    """silu(gate) * up of a fused gate_up projection's output [T, 2I], gate columns first."""

    gate_up: torch.Tensor

    @property
    def rows(self) -> int:
        return self.gate_up.shape[0]


def normed_input(delta: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> NormedInput:
    """The norm's inputs, with the buffer the GEMM fills with the new residual (a new tensor: every program of
    the GEMM reads the old one while the first writes the sum)."""
    new_residual = residual if delta is None else torch.empty_like(residual)
    return NormedInput(delta, residual, weight, eps, new_residual)
