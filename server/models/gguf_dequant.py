"""GGUF tensor bytes → float32 torch tensors.

The formats GGUF files of language models are made of are dequantised here with torch, a few whole-tensor ops
per tensor: F32, F16, BF16, the 32-element block formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL) and the
256-element K-quants (Q2_K … Q6_K, IQ4_XS) — every type a Q2_K … Q8_0 "mix" (Q4_K_M, Q5_K_M, …) contains,
including the fallbacks llama.cpp picks for rows that are not a multiple of 256. Each computes the same float32
operations in the same order as gguf.quants, so the weights are bit-identical to its reference (tested per
type). Other types the gguf package knows (the IQ1/IQ2/IQ3 lattices, TQ1_0/TQ2_0, MXFP4) go through its numpy
reference (on a plain array, not a memory map: numpy's memmap subclass made that path 4x slower); a type neither
reads is an UnsupportedGGMLType naming it.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from metronome.server.models import gguf_iquants, gguf_kquants, gguf_legacy

F32, F16, BF16 = 0, 1, 30
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 2, 3, 6, 7, 8
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K = 10, 11, 12, 13, 14, 15
IQ4_NL, IQ4_XS = 20, 23
CHUNK_ELEMENTS = 1 << 19
_PLAIN = {F32: 4, F16: 2, BF16: 2}  # bytes per element
# llama.cpp's scratch formats for activations in its dot products; no converter writes them into a model file.
_ACTIVATION_ONLY = {9: "Q8_1", Q8_K: "Q8_K"}


class UnsupportedGGMLType(ValueError):
    """A tensor type this server cannot dequantise; the message names it."""


@dataclass(frozen=True)
class BlockFormat:
    name: str
    block: int  # elements per block
    block_bytes: int
    dequantize: Callable[[torch.Tensor], torch.Tensor]  # uint8 [blocks, block_bytes] → float32 [blocks, block]


FORMATS: dict[int, BlockFormat] = {
    Q4_0: BlockFormat("Q4_0", 32, 18, gguf_legacy.q4_0),
    Q4_1: BlockFormat("Q4_1", 32, 20, gguf_legacy.q4_1),
    Q5_0: BlockFormat("Q5_0", 32, 22, gguf_legacy.q5_0),
    Q5_1: BlockFormat("Q5_1", 32, 24, gguf_legacy.q5_1),
    Q8_0: BlockFormat("Q8_0", 32, 34, gguf_legacy.q8_0),
    Q2_K: BlockFormat("Q2_K", 256, 84, gguf_kquants.q2_k),
    Q3_K: BlockFormat("Q3_K", 256, 110, gguf_kquants.q3_k),
    Q4_K: BlockFormat("Q4_K", 256, 144, gguf_kquants.q4_k),
    Q5_K: BlockFormat("Q5_K", 256, 176, gguf_kquants.q5_k),
    Q6_K: BlockFormat("Q6_K", 256, 210, gguf_kquants.q6_k),
    IQ4_NL: BlockFormat("IQ4_NL", 32, 18, gguf_iquants.iq4_nl),
    IQ4_XS: BlockFormat("IQ4_XS", 256, 136, gguf_iquants.iq4_xs),
}


def type_name(ggml_type: int) -> str:
    """The ggml type's name (Q4_K, F32, …), or `type <n>` for a number no gguf version knows."""
    if ggml_type in FORMATS:
        return FORMATS[ggml_type].name
    from gguf.constants import GGMLQuantizationType

    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"type {ggml_type}"


def tensor_nbytes(ggml_type: int, elements: int) -> int:
    """Bytes that `elements` values of this type occupy in the file."""
    if ggml_type in _PLAIN:
        return elements * _PLAIN[ggml_type]
    if ggml_type in FORMATS:
        return elements // FORMATS[ggml_type].block * FORMATS[ggml_type].block_bytes
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        raise UnsupportedGGMLType(f"ggml {type_name(ggml_type)} is not a type the gguf package knows") from None
    return elements // block * block_bytes


def dequantize(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> torch.Tensor:
    """`raw` (uint8, the tensor's bytes) as a float32 tensor of numpy `shape` (slowest dimension first)."""
    if ggml_type == F32:
        return torch.from_numpy(raw.view(np.float32).copy()).reshape(shape)
    if ggml_type == F16:
        return torch.from_numpy(raw.view(np.float16).astype(np.float32)).reshape(shape)
    if ggml_type == BF16:
        return _bytes(raw).view(torch.bfloat16).float().reshape(shape)
    if ggml_type in _ACTIVATION_ONLY:
        raise UnsupportedGGMLType(f"ggml type {_ACTIVATION_ONLY[ggml_type]} is llama.cpp's activation format, "
                                  "not a weight format; the file is damaged or not a model")
    if ggml_type in FORMATS:
        form = FORMATS[ggml_type]
        if shape and shape[-1] % form.block:
            raise UnsupportedGGMLType(f"rows of {shape[-1]} values are not whole {form.name} blocks of "
                                      f"{form.block}")
        return _dequantize_blocks(form, _bytes(raw).view(-1, form.block_bytes)).reshape(shape)
    return _gguf_reference(raw, ggml_type, shape)


def _dequantize_blocks(form: BlockFormat, blocks: torch.Tensor) -> torch.Tensor:
    """All blocks, a slice of CHUNK_ELEMENTS at a time: the format's intermediates then stay in the CPU's cache
    and the allocator reuses their memory, where whole-tensor intermediates of a large matrix each cost a pass
    through main memory and fresh pages (measured: 1.5-2x faster on a 64M-element tensor)."""
    step = max(1, CHUNK_ELEMENTS // form.block)
    if blocks.shape[0] <= step:
        return form.dequantize(blocks)
    out = torch.empty(blocks.shape[0], form.block, dtype=torch.float32, device=blocks.device)
    for start in range(0, blocks.shape[0], step):
        out[start:start + step] = form.dequantize(blocks[start:start + step])
    return out


def _bytes(raw: np.ndarray) -> torch.Tensor:
    """The bytes as a uint8 tensor without a copy. `raw` is a read-only memory map: the formats only read it
    (their results are new tensors), so torch's warning about non-writable arrays does not apply."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(raw)


def _gguf_reference(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> torch.Tensor:
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    name = type_name(ggml_type)
    try:
        kind = GGMLQuantizationType(ggml_type)
    except ValueError:
        raise UnsupportedGGMLType(f"ggml {name} is not a type the gguf package knows") from None
    rows = raw.reshape(-1, raw.size // shape[0]) if len(shape) > 1 else raw
    try:
        array = np.asarray(gguf_dequantize(np.array(rows), kind), dtype=np.float32)
    except NotImplementedError:
        raise UnsupportedGGMLType(f"ggml type {name} cannot be dequantised (the gguf package has no "
                                  "dequantiser for it either)") from None
    return torch.from_numpy(np.ascontiguousarray(array)).reshape(shape)
