"""An activation quantised to FP8 for the next linear layer, and how it is made.

`Fp8Activation` is what flows from a norm or SiLU·mul into an `Fp8Linear` when the producing kernel quantises
its own output (the fused path on CUDA); otherwise the linear layer quantises its bf16 input itself with
`quantize_activation`. On CUDA that is one Triton launch (kernels/triton_fp8.py); elsewhere the torch reference
of quant/fp8.py, which the kernels match.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from metronome.server.models.quant import fp8


@dataclass(frozen=True)
class ActivationQuant:
    """How a layer wants its input quantised: `group` None = per token; `static_scale` set = one calibrated
    per-tensor scale (then group is None); `amax_ub` bounds a token's amax (per token only)."""
    group: int | None = None
    static_scale: torch.Tensor | None = None
    amax_ub: float | None = None


@dataclass
class Fp8Activation:
    q: torch.Tensor  # e4m3 [T, K]
    scale: torch.Tensor  # float32: 0-d (static), [T, 1] (per token) or [T, ceil(K / group)] (per group)
    dtype: torch.dtype  # the model dtype the activation had (and the linear's output gets)
    group: int | None = None

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self) -> torch.Tensor:
        """float32 [T, K]: q times its scale(s)."""
        scale = self.scale
        if self.group is not None:
            scale = fp8.expand_groups(scale, self.q.shape[-1], self.group)
        return fp8.dequantize(self.q, scale)


def quantize_reference(x: torch.Tensor, how: ActivationQuant) -> Fp8Activation:
    """The torch reference (the CPU path, and what the kernels are tested against)."""
    if how.static_scale is not None:
        q, scale = fp8.quantize_per_tensor(x, how.static_scale)
    elif how.group is not None:
        q, scale = fp8.quantize_per_group(x, how.group)
    else:
        q, scale = fp8.quantize_per_token(x, how.amax_ub)
    return Fp8Activation(q, scale, x.dtype, how.group)


def quantize_activation(x: torch.Tensor, how: ActivationQuant) -> Fp8Activation:
    """x [T, K] in the model dtype → Fp8Activation; a Triton launch on CUDA, the torch reference elsewhere."""
    if x.device.type != "cuda":
        return quantize_reference(x, how)
    from metronome.kernels.triton_fp8 import quantize_fp8

    q, scale = quantize_fp8(x.contiguous(), how.group, how.static_scale, amax_ub=how.amax_ub)
    return Fp8Activation(q, scale, x.dtype, how.group)
