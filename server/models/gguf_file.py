"""A lazy GGUF reader: the header, the metadata and the tensor table, read from a memory map on demand.

gguf's own GGUFReader builds a numpy view for every part of every field up front; for a 50k-entry vocabulary
and its merges that is seconds of a cold start, spent on strings only the tokenizer needs (and transformers
reads those itself). Here scalars and strings are read at open; a string array is only walked past and kept as
a `StringArray` that decodes its entries when someone asks. Tensor data stays in the map until a caller takes
`raw(tensor)`, a zero-copy uint8 view.

Format (little-endian, versions 2 and 3): magic "GGUF", version u32, tensor count u64, metadata count u64; each
metadata entry is a string key, a u32 type and the value; then per tensor its name, u32 dimension count, u64
dimensions (fastest-moving first), u32 ggml type and u64 offset into the data section, which starts at the next
multiple of `general.alignment` (32 by default).
"""
from __future__ import annotations

import mmap
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
DEFAULT_ALIGNMENT = 32


class GGUFFormatError(ValueError):
    """The file is not a GGUF this reader understands; the message says where it went wrong."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # ggml order: the fastest-moving dimension first (numpy shape is this reversed)
    ggml_type: int
    offset: int  # from the start of the file


class StringArray:
    """A metadata array of strings, decoded only when read (len() is free)."""

    def __init__(self, buffer, start: int, count: int):
        self._buffer, self._start, self._count = buffer, start, count
        self._values: list[str] | None = None

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[str]:
        return iter(self.values())

    def __getitem__(self, index):
        return self.values()[index]

    def values(self) -> list[str]:
        if self._values is None:
            values, pos, buffer = [], self._start, self._buffer
            for _ in range(self._count):
                (length,) = struct.unpack_from("<Q", buffer, pos)
                values.append(bytes(buffer[pos + 8:pos + 8 + length]).decode("utf-8", errors="replace"))
                pos += 8 + length
            self._values = values
        return self._values


class GGUFFile:
    """`metadata` (dict of Python values; string arrays as StringArray), `tensors` (TensorInfo list)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        with open(self.path, "rb") as handle:
            self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        self._view = memoryview(self._map)
        try:
            self.metadata, self.tensors, self.data_start = _parse(self._view)
        except (struct.error, UnicodeDecodeError, IndexError) as error:
            raise GGUFFormatError(f"truncated or corrupt GGUF header: {error}") from None
        end = len(self._map)
        for tensor in self.tensors:
            if tensor.offset > end:
                raise GGUFFormatError(f"tensor {tensor.name} starts past the end of the file")

    def raw(self, tensor: TensorInfo, nbytes: int) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 array over the map (no copy)."""
        if tensor.offset + nbytes > len(self._map):
            raise GGUFFormatError(f"tensor {tensor.name} runs past the end of the file")
        return np.frombuffer(self._map, dtype=np.uint8, count=nbytes, offset=tensor.offset)


def _parse(buffer) -> tuple[dict[str, Any], list[TensorInfo], int]:
    if bytes(buffer[:4]) != b"GGUF":
        raise GGUFFormatError("not a GGUF file (no GGUF magic)")
    version, tensor_count, kv_count = struct.unpack_from("<IQQ", buffer, 4)
    if version not in (2, 3):
        raise GGUFFormatError(f"GGUF version {version} is not supported (2 and 3 are)")
    pos = 24
    metadata: dict[str, Any] = {}
    for _ in range(kv_count):
        key, pos = _string(buffer, pos)
        (value_type,) = struct.unpack_from("<I", buffer, pos)
        metadata[key], pos = _value(buffer, pos + 4, value_type)
    infos = []
    for _ in range(tensor_count):
        name, pos = _string(buffer, pos)
        (dims,) = struct.unpack_from("<I", buffer, pos)
        shape = struct.unpack_from(f"<{dims}Q", buffer, pos + 4)
        pos += 4 + 8 * dims
        ggml_type, offset = struct.unpack_from("<IQ", buffer, pos)
        pos += 12
        infos.append((name, tuple(int(d) for d in shape), ggml_type, offset))
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT)) or DEFAULT_ALIGNMENT
    data_start = (pos + alignment - 1) // alignment * alignment
    tensors = [TensorInfo(name, shape, ggml_type, data_start + offset) for name, shape, ggml_type, offset in infos]
    return metadata, tensors, data_start


def _string(buffer, pos: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", buffer, pos)
    end = pos + 8 + length
    if end > len(buffer):
        raise GGUFFormatError(f"a string at byte {pos} runs past the end of the file")
    return bytes(buffer[pos + 8:end]).decode("utf-8"), end


def _value(buffer, pos: int, value_type: int) -> tuple[Any, int]:
    if value_type in _SCALARS:
        fmt = _SCALARS[value_type]
        return struct.unpack_from(fmt, buffer, pos)[0], pos + struct.calcsize(fmt)
    if value_type == _STRING:
        return _string(buffer, pos)
    if value_type == _ARRAY:
        element_type, count = struct.unpack_from("<IQ", buffer, pos)
        pos += 12
        if element_type in _SCALARS:
            fmt = _SCALARS[element_type]
            width = struct.calcsize(fmt)
            values = np.frombuffer(buffer, dtype=np.dtype(fmt), count=count, offset=pos).tolist()
            return values, pos + width * count
        if element_type == _STRING:
            start = pos
            for _ in range(count):  # only the lengths are read here
                (length,) = struct.unpack_from("<Q", buffer, pos)
                pos += 8 + length
            return StringArray(buffer, start, count), pos
        if element_type == _ARRAY:
            values = []
            for _ in range(count):  # each element is an array header and its values
                value, pos = _value(buffer, pos, _ARRAY)
                values.append(value)
            return values, pos
    raise GGUFFormatError(f"unknown GGUF metadata value type {value_type} at byte {pos}")
