"""GGUF tensor bytes → float32 torch tensors.

The block formats llama.cpp's small models ship (Q4_0, Q4_1, Q8_0) are dequantised here with torch, a few
vectorised ops per tensor; every other type goes through gguf's numpy reference (on a plain array, not a
memory map: numpy's memmap subclass made that path 4x slower). Both compute the same float32 operations in the
same order as gguf.quants, so the weights are bit-identical either way.
"""
from __future__ import annotations

import numpy as np
import torch

F32, F16, Q4_0, Q4_1, Q8_0, BF16 = 0, 1, 2, 3, 8, 30
BLOCK = 32  # elements per block of the Q4_0/Q4_1/Q8_0 formats
_BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34}
_PLAIN = {F32: (np.float32, 4), F16: (np.float16, 2)}


def tensor_nbytes(ggml_type: int, elements: int) -> int:
    """Bytes that `elements` values of this type occupy in the file."""
    if ggml_type in _PLAIN:
        return elements * _PLAIN[ggml_type][1]
    if ggml_type == BF16:
        return elements * 2
    if ggml_type in _BLOCK_BYTES:
        return elements // BLOCK * _BLOCK_BYTES[ggml_type]
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    return elements // block * block_bytes


def dequantize(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> torch.Tensor:
    """`raw` (uint8, the tensor's bytes) as a float32 tensor of numpy `shape` (slowest dimension first)."""
    if ggml_type == F32:
        return torch.from_numpy(raw.view(np.float32).copy()).reshape(shape)
    if ggml_type == F16:
        return torch.from_numpy(raw.view(np.float16).astype(np.float32)).reshape(shape)
    if ggml_type == BF16:
        return torch.from_numpy(raw.copy()).view(torch.bfloat16).float().reshape(shape)
    if ggml_type in _BLOCK_BYTES:
        blocks = torch.from_numpy(raw.copy()).view(-1, _BLOCK_BYTES[ggml_type])
        return _DEQUANT[ggml_type](blocks).reshape(shape)
    return _gguf_reference(raw, ggml_type, shape)


def _scale(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """A float16 per block at byte `start`, as float32 [blocks, 1]."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """16 bytes per block → 32 4-bit values: the low nibbles are elements 0..15, the high ones 16..31."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=1)


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    q = _nibbles(blocks[:, 2:]).to(torch.int8) - 8
    return _scale(blocks, 0) * q.float()


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    q = _nibbles(blocks[:, 4:]).float()
    return _scale(blocks, 0) * q + _scale(blocks, 2)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    q = blocks[:, 2:].contiguous().view(torch.int8).float()
    return _scale(blocks, 0) * q


_DEQUANT = {Q4_0: _q4_0, Q4_1: _q4_1, Q8_0: _q8_0}


def _gguf_reference(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> torch.Tensor:
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    kind = GGMLQuantizationType(ggml_type)
    rows = raw.reshape(-1, raw.size // shape[0]) if len(shape) > 1 else raw
    array = np.asarray(gguf_dequantize(np.array(rows), kind), dtype=np.float32)
    return torch.from_numpy(np.ascontiguousarray(array)).reshape(shape)
