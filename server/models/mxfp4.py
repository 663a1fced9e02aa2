"""MXFP4 expert weights (gpt-oss checkpoints) → bf16/fp32 tensors at load.

A row of K values is stored as K/32 blocks: `<name>_blocks` uint8 [..., K/32, 16] (two FP4 e2m1 codes a byte, the
low nibble first) and `<name>_scales` uint8 [..., K/32] (an e8m0 exponent per block, biased by 127). A value is
E2M1[code] * 2^(scale - 127). Every such product is exact in bf16 (two significant bits, an 8-bit exponent), so
dequantising straight into the model dtype loses nothing, and Hopper has no FP4 tensor cores to use them as is.
The arithmetic (a table lookup in the target dtype, then ldexp) is transformers' `convert_moe_packed_tensors`,
without its final transpose: the result keeps the checkpoint's [..., rows, K] layout.
"""
from __future__ import annotations

import torch

# The 16 FP4 (e2m1) values by code: sign bit 3, two exponent bits, one mantissa bit.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK_VALUES = 32
SCALE_BIAS = 127


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks uint8 [..., G, 16], scales uint8 [..., G] → dtype [..., G * 32], on blocks' device."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] != BLOCK_VALUES // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair up "
                         f"(blocks [..., G, 16] with scales [..., G])")
    table = torch.tensor(E2M1_VALUES, dtype=dtype, device=blocks.device)
    *prefix, groups, half = blocks.shape
    flat = blocks.reshape(-1, half)
    out = torch.empty(flat.shape[0], 2 * half, dtype=dtype, device=blocks.device)
    out[:, 0::2] = table[(flat & 0x0F).long()]
    out[:, 1::2] = table[(flat >> 4).long()]
    exponents = scales.to(device=blocks.device).reshape(-1, 1).to(torch.int32) - SCALE_BIAS
    torch.ldexp(out, exponents, out=out)
    return out.reshape(*prefix, groups * 2 * half)
