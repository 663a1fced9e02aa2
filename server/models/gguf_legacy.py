"""llama.cpp's 32-element block formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) → float32, with torch.

Each function takes uint8 blocks [blocks, block_bytes] and returns float32 [blocks, 32], computing the same
float32 operations in the same order as gguf.quants, so the values are bit-identical to its reference. K-quant
files carry these too: llama.cpp falls back to Q5_0/Q5_1/Q8_0 for tensors whose rows are not a multiple of 256.

Layouts (f16 = float16 scale, nibble i of the 16 packed bytes: low nibbles are elements 0..15, high 16..31):
Q4_0 d:f16, qs[16]: d*(q-8).  Q4_1 d, m:f16, qs[16]: d*q+m.  Q5_0 d, qh:u32, qs[16]: d*((q|h<<4)-16), bit i of
qh is element i's fifth bit.  Q5_1 d, m, qh, qs: d*(q|h<<4)+m.  Q8_0 d, qs:int8[32]: d*q.
"""
from __future__ import annotations

import torch

from metronome.server.models.gguf_bits import field, half, unpack


def _nibbles(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The 32 4-bit values of the 16 bytes at `start`, in element order, uint8 [blocks, 32]."""
    return unpack(field(blocks, start, 16), 4).reshape(-1, 32)


def _fifth_bits(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The 32 bits of the little-endian u32 at `start` shifted to bit 4, uint8 [blocks, 32]."""
    return unpack(field(blocks, start, 4).unsqueeze(-1), 1).reshape(-1, 32) << 4


def q4_0(blocks: torch.Tensor) -> torch.Tensor:
    q = _nibbles(blocks, 2).view(torch.int8) - 8
    return torch.mul(q, half(blocks, 0))


def q4_1(blocks: torch.Tensor) -> torch.Tensor:
    return torch.mul(_nibbles(blocks, 4), half(blocks, 0)).add_(half(blocks, 2))


def q5_0(blocks: torch.Tensor) -> torch.Tensor:
    q = (_nibbles(blocks, 6) | _fifth_bits(blocks, 2)).view(torch.int8) - 16
    return torch.mul(q, half(blocks, 0))


def q5_1(blocks: torch.Tensor) -> torch.Tensor:
    q = _nibbles(blocks, 8) | _fifth_bits(blocks, 4)
    return torch.mul(q, half(blocks, 0)).add_(half(blocks, 2))


def q8_0(blocks: torch.Tensor) -> torch.Tensor:
    return torch.mul(field(blocks, 2, 32).view(torch.int8), half(blocks, 0))
