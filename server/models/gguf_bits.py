"""Reading the fields of GGUF quantised blocks with torch: half-precision scales and packed small integers.

Every block format is a row of bytes per block (a uint8 tensor [blocks, block_bytes]); these helpers take
fields out of all blocks at once, so a format is a handful of whole-tensor ops with no loop over blocks.
"""
from __future__ import annotations

import functools

import torch


def half(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 at byte `start` of every block, as float32 [blocks, 1]."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def field(blocks: torch.Tensor, start: int, nbytes: int) -> torch.Tensor:
    """Bytes start..start+nbytes of every block (a strided view, no copy)."""
    return blocks[:, start:start + nbytes]


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Split each byte into 8/bits fields, lowest bits first, on a new second-to-last dimension.

    [..., L] uint8 → [..., 8/bits, L]: entry [..., j, i] is bits j*bits..(j+1)*bits-1 of byte i. llama.cpp lays
    its sub-blocks out this way: for 4-bit fields the low nibbles of L bytes are L elements and the high
    nibbles the next L."""
    return (packed.unsqueeze(-2) >> _shifts(bits, packed.device)) & ((1 << bits) - 1)


@functools.cache
def _shifts(bits: int, device: torch.device) -> torch.Tensor:
    return torch.arange(0, 8, bits, dtype=torch.uint8, device=device).view(-1, 1)
