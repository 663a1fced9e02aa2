"""llama.cpp's K-quants (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) → float32, with torch.

A K-quant block is a 256-element super-block: one or two float16 factors and 8 or 16 sub-block scales (and
mins) packed in 4 or 6 bits, then the quantised values packed in 2 to 6 bits. Each function takes uint8 blocks
[blocks, block_bytes] and returns float32 [blocks, 256], computing the same float32 operations in the same
order as gguf.quants (the sub-block scale is d × scale first, then times the value, then minus dmin × min), so
the result is bit-identical to its reference. Every step is one op over all blocks.

Layouts, in byte order:
- Q2_K (84):  scales[16] (4-bit scale | 4-bit min), qs[64] (2 bits), d, dmin: d·sc·q − dmin·m per 16.
- Q3_K (110): hmask[32] (high bit, set = no offset), qs[64] (low 2 bits), scales[12] (16 × 6 bits, −32), d:
  d·sc·(q − 4·(1 − h)) per 16.
- Q4_K (144): d, dmin, scales[12] (8 scales and 8 mins, 6 bits each), qs[128] (4 bits): d·sc·q − dmin·m per 32.
- Q5_K (176): d, dmin, scales[12], qh[32] (fifth bit), qs[128]: as Q4_K with 5-bit values.
- Q6_K (210): ql[128] (low 4 bits), qh[64] (high 2 bits), scales:int8[16], d: d·sc·(q − 32) per 16.
"""
from __future__ import annotations

import torch

from metronome.server.models.gguf_bits import field, half, unpack

QK_K = 256


def q2_k(blocks: torch.Tensor) -> torch.Tensor:
    scales = field(blocks, 0, 16)
    scale = torch.mul(scales & 0x0F, half(blocks, 80)).unsqueeze(-1)
    minimum = torch.mul(scales >> 4, half(blocks, 82)).unsqueeze(-1)
    q = unpack(field(blocks, 16, 64).reshape(-1, 2, 32), 2).reshape(-1, 16, 16)
    return torch.mul(q, scale).sub_(minimum).reshape(-1, QK_K)


def q3_k(blocks: torch.Tensor) -> torch.Tensor:
    low = unpack(field(blocks, 96, 8), 4).reshape(-1, 16)
    high = unpack(field(blocks, 104, 4), 2).reshape(-1, 16)
    sub_scales = (low | (high << 4)).view(torch.int8) - 32
    scale = torch.mul(sub_scales, half(blocks, 108)).unsqueeze(-1)
    q_low = unpack(field(blocks, 32, 64).reshape(-1, 2, 32), 2).reshape(-1, 16, 16)
    no_offset = unpack(field(blocks, 0, 32).reshape(-1, 1, 32), 1).reshape(-1, 16, 16)
    q = q_low.view(torch.int8) - ((no_offset ^ 1) << 2).view(torch.int8)
    return torch.mul(q, scale).reshape(-1, QK_K)


def k_scales_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit scales and 8 six-bit mins of Q4_K/Q5_K from their 12 bytes, uint8 [blocks, 8] each.

    Bytes 0-3 hold scales 0-3 in their low 6 bits, bytes 4-7 mins 0-3; bytes 8-11 hold the low 4 bits of scales
    4-7 (low nibble) and mins 4-7 (high nibble), whose top 2 bits are the top bits of bytes 0-3 and 4-7."""
    rows = packed.reshape(-1, 3, 4)
    first, second, third = rows[:, 0], rows[:, 1], rows[:, 2]
    scales = torch.cat([first & 0x3F, (third & 0x0F) | ((first >> 2) & 0x30)], dim=-1)
    mins = torch.cat([second & 0x3F, (third >> 4) | ((second >> 2) & 0x30)], dim=-1)
    return scales, mins


def _k_dequantize(blocks: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """d·sc·q − dmin·m for Q4_K/Q5_K, whose values `q` are uint8 [blocks, 8, 32]."""
    scales, mins = k_scales_mins(field(blocks, 4, 12))
    scale = torch.mul(scales, half(blocks, 0)).unsqueeze(-1)
    minimum = torch.mul(mins, half(blocks, 2)).unsqueeze(-1)
    return torch.mul(q, scale).sub_(minimum).reshape(-1, QK_K)


def q4_k(blocks: torch.Tensor) -> torch.Tensor:
    q = unpack(field(blocks, 16, 128).reshape(-1, 4, 32), 4).reshape(-1, 8, 32)
    return _k_dequantize(blocks, q)


def q5_k(blocks: torch.Tensor) -> torch.Tensor:
    low = unpack(field(blocks, 48, 128).reshape(-1, 4, 32), 4).reshape(-1, 8, 32)
    high = unpack(field(blocks, 16, 32).reshape(-1, 1, 32), 1).reshape(-1, 8, 32)
    return _k_dequantize(blocks, low | (high << 4))


def q6_k(blocks: torch.Tensor) -> torch.Tensor:
    low = unpack(field(blocks, 0, 128).reshape(-1, 2, 64), 4).reshape(-1, 8, 32)
    high = unpack(field(blocks, 128, 64).reshape(-1, 2, 32), 2).reshape(-1, 8, 32)
    q = ((low | (high << 4)).view(torch.int8) - 32).reshape(-1, 16, 16)
    scale = torch.mul(field(blocks, 192, 16).view(torch.int8), half(blocks, 208)).unsqueeze(-1)
    return torch.mul(q, scale).reshape(-1, QK_K)
