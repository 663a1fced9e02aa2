"""llama.cpp's non-linear 4-bit formats IQ4_NL and IQ4_XS → float32, with torch.

Their 4-bit values index a fixed table of 16 int8 levels instead of being the level itself. IQ4_NL is a
32-element block (d:f16, qs[16]: d·level[q]); IQ4_XS a 256-element super-block (d:f16, scales_h:u16 (2 high
bits of each of 8 sub-block scales), scales_l[4] (4 low bits each), qs[128]: d·(sc − 32)·level[q] per 32).
llama.cpp uses IQ4_NL where a K-quant does not fit a tensor's rows in its IQ and low-bit mixes. Same float32
operations in the same order as gguf.quants, so bit-identical to its reference.
"""
from __future__ import annotations

import functools

import torch

from metronome.server.models.gguf_bits import field, half, unpack

LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


@functools.cache
def _levels(device: torch.device) -> torch.Tensor:
    return torch.tensor(LEVELS, dtype=torch.int8, device=device)


def _level(q: torch.Tensor) -> torch.Tensor:
    return _levels(q.device)[q.int()]


def iq4_nl(blocks: torch.Tensor) -> torch.Tensor:
    q = unpack(field(blocks, 2, 16), 4).reshape(-1, 32)
    return torch.mul(_level(q), half(blocks, 0))


def iq4_xs(blocks: torch.Tensor) -> torch.Tensor:
    low = unpack(field(blocks, 4, 4).unsqueeze(-1), 4).reshape(-1, 8)
    high = unpack(field(blocks, 2, 2).unsqueeze(-1), 2).reshape(-1, 8)
    sub_scales = (low | (high << 4)).view(torch.int8) - 32
    scale = torch.mul(sub_scales, half(blocks, 0)).unsqueeze(-1)
    q = unpack(field(blocks, 8, 128).reshape(-1, 8, 16), 4).reshape(-1, 8, 32)
    return torch.mul(_level(q), scale).reshape(-1, 256)
