"""The FP8 GEMM of an `Fp8Linear` on CUDA: which kernel runs for which scales and batch size.

- block-scaled weights: the Triton kernel of kernels/triton_fp8.py, scales applied per 128-column group inside
  the K loop;
- one scale per operand (static per-tensor activations, weights requantised to one scale): `torch._scaled_mm`
  with 0-d scales (cuBLASLt) writing the model dtype directly — no epilogue;
- per-token activation scales with per-channel (or per-tensor) weight scales, two ways:
  `rowwise`: `torch._scaled_mm` with [M, 1] and [1, N] scales (CUTLASS sm90 kernel), one kernel writing the
  model dtype;
  `tensorwise`: `torch._scaled_mm` with unit 0-d scales into float32, then the row and column scales multiplied
  in (three more passes over [M, N]);
  `rowwise` is the faster of the two at every Llama-3-8B shape from 1 to 8,192 rows (docs/perf/fp8-h200.md),
  `tensorwise` 1.09-2.38x slower;
- `skinny`: at decode-sized batches (M <= 64) the Triton small-M kernel of kernels/triton_fp8_skinny.py (operands
  swapped so the weight streams through many narrow column tiles), any per-tensor or per-channel layout; larger
  batches take `rowwise`;
- `triton`: the Triton kernel for every layout (also the fallback when K or N is not a multiple of 16, which
  `_scaled_mm` requires).

`auto` runs `skinny` up to SKINNY_ROWS rows, `rowwise` up to TRITON_ROWS and the Triton kernel above, where its
128 x 256 tiles beat the CUTLASS rowwise kernel: on the H200 at Llama-3-8B's four shapes together, by 12 % at 960
rows (a saturated decode batch of 921), even at 1,024, 2 % at 2,048 and 9-12 % at 4,096-8,192 (prefill chunks),
while `rowwise` is 4-22 % faster than the kernel's 128 x 128 tiles from 256 to 768 rows (docs/perf/fp8-h200.md).
A layer with a 0-d scale on both operands keeps the per-tensor `_scaled_mm`, faster than either.
`METRONOME_FP8_GEMM=auto|skinny|rowwise|tensorwise|triton` picks one for benchmarking (read when a model is
loaded); everything here is capturable in a CUDA graph.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from metronome.kernels.fp8_tiles import LARGE_ROWS
from metronome.server.models.quant.activation import Fp8Activation

if TYPE_CHECKING:
    from metronome.server.models.quant.fp8_linear import Fp8Linear

GEMMS = ("auto", "skinny", "rowwise", "tensorwise", "triton")
SKINNY_ROWS = 64  # `auto` takes the small-M kernel up to here
TRITON_ROWS = LARGE_ROWS  # ... and the Triton kernel above here, where its 128 x 256 tiles start
GEMM_ENV = "METRONOME_FP8_GEMM"


def gemm_from_environment() -> str:
    choice = os.environ.get(GEMM_ENV, "auto").strip().lower() or "auto"
    if choice not in GEMMS:
        raise ValueError(f"{GEMM_ENV}={choice!r}: use one of {', '.join(GEMMS)}")
    return choice


def per_token_path(choice: str, m: int, scalar_scales: bool = False) -> str:
    """The path an M-row activation with per-token (or static) scales takes for a layer's GEMM choice, `auto`
    resolved: `skinny` up to SKINNY_ROWS rows, `rowwise` (the `_scaled_mm` path) up to TRITON_ROWS, `triton`
    above unless both operands have one scale each (`scalar_scales`: the per-tensor `_scaled_mm` wins there).
    `skinny` takes the small-M kernel where its rows fit and `rowwise` elsewhere."""
    if choice in ("auto", "skinny"):
        if m <= SKINNY_ROWS:
            return "skinny"
        return "triton" if choice == "auto" and m > TRITON_ROWS and not scalar_scales else "rowwise"
    return choice


def fp8_gemm(act: Fp8Activation, layer: Fp8Linear) -> torch.Tensor:
    """act [M, K] (FP8) @ layer.weight^T with both operands' scales → [M, N] in act.dtype (+ bias)."""
    from metronome.kernels.triton_fp8 import fp8_matmul

    q, weight = act.q, layer.weight
    m, k = q.shape
    n = weight.shape[0]
    bias = layer.bias
    if layer.granularity == "block":
        return fp8_matmul(q, act.scale, weight, layer.weight_scale, act.dtype, bias, group_k=layer.block[1])
    a_scalar, w_scalar = act.scale.dim() == 0, layer.weight_scale.dim() == 0
    path = per_token_path(layer.gemm, m, a_scalar and w_scalar)
    if path == "triton" or k % 16 or n % 16 or m == 0 or act.group is not None:
        return fp8_matmul(q, act.scale, weight, layer.weight_scale, act.dtype, bias)
    if path == "skinny":
        from metronome.kernels.triton_fp8_skinny import fp8_skinny_matmul
        return fp8_skinny_matmul(q, act.scale, weight, layer.weight_scale, act.dtype, bias)
    if a_scalar and w_scalar:
        return torch._scaled_mm(q, weight.t(), scale_a=act.scale, scale_b=layer.weight_scale, bias=bias,
                                out_dtype=act.dtype)
    if path == "rowwise":
        scale_a = act.scale.expand(m, 1).contiguous() if a_scalar else act.scale
        out = torch._scaled_mm(q, weight.t(), scale_a=scale_a, scale_b=layer.column_scale, out_dtype=act.dtype)
        return out if bias is None else out.add_(bias)
    unit = layer.unit_scale
    out = torch._scaled_mm(q, weight.t(), scale_a=unit, scale_b=unit, out_dtype=torch.float32)
    out.mul_(act.scale).mul_(layer.weight_scale)
    if bias is not None:
        out.add_(bias)
    return out.to(act.dtype)
