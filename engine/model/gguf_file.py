"""A GGUF file's metadata and tensors, read the way `gguf.GGUFReader` presents them, in a fraction
of its time.

GGUFReader builds a numpy view for every part of every metadata value: the SmolLM2 file's 49,152
vocabulary strings and 48,900 merges took 5.4 s of a 7.6 s model load on a 2-vCPU EPYC, in every
process that loads the model (each server start, each engine a test builds). Here the metadata is
parsed with struct from one read of the header, and each tensor is a numpy view of the memory-
mapped file, with the same dtype and shape GGUFReader gives it (F32/F16/... as typed arrays, the
quantized types as uint8 rows of blocks), so `gguf.quants.dequantize` accepts it unchanged.

Layout (GGUF v2/v3, little-endian): magic, version, tensor count, metadata count; metadata
(key, value type, value); tensor infos (name, dims innermost first, type, offset); padding to
`general.alignment`; tensor data.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF metadata value types -> struct format (0-7, 10-12 scalars; 8 string; 9 array)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9
# ggml tensor types read as typed arrays (everything else is blocks of bytes)
_TYPED = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64, 28: np.float64}


class GGUFFormatError(ValueError):
    pass


@dataclass(frozen=True)
class Field:
    name: str
    value: Any

    def contents(self) -> Any:
        """The value as Python data: str, int, float, bool, or a list of them (GGUFReader's contents())."""
        return self.value


@dataclass(frozen=True)
class Tensor:
    name: str
    tensor_type: int  # ggml type id (gguf.GGMLQuantizationType)
    shape: tuple[int, ...]  # innermost dimension first, as the file lists them
    data: np.ndarray  # a read-only view of the file


class GGUFFile:
    """fields: metadata key -> Field; tensors: in file order."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        buffer = memoryview(self._map)
        if bytes(buffer[:4]) != MAGIC:
            raise GGUFFormatError(f"not a GGUF file (magic {bytes(buffer[:4])!r}, want {MAGIC!r})")
        self._buffer, self._offset = buffer, 4
        try:
            version = self._scalar(4)
            if version not in (2, 3):
                raise GGUFFormatError(f"GGUF version {version} is not supported (2 or 3)")
            tensor_count, field_count = self._scalar(10), self._scalar(10)
            self.fields: dict[str, Field] = {}
            for _ in range(field_count):
                key = self._string()
                self.fields[key] = Field(key, self._value(self._scalar(4)))
            infos = [self._tensor_info() for _ in range(tensor_count)]
        except (struct.error, UnicodeDecodeError, IndexError) as exc:
            raise GGUFFormatError(f"truncated or corrupt GGUF header at byte {self._offset}: {exc}") from exc
        alignment = int(self.fields["general.alignment"].value) if "general.alignment" in self.fields \
            else DEFAULT_ALIGNMENT
        if alignment <= 0 or alignment & (alignment - 1):
            raise GGUFFormatError(f"general.alignment {alignment} is not a power of two")
        data_start = -(-self._offset // alignment) * alignment
        self.tensors = [self._tensor(data_start, *info) for info in infos]
        del self._buffer

    def _scalar(self, kind: int):
        fmt = _SCALARS[kind]
        (value,) = struct.unpack_from(fmt, self._buffer, self._offset)
        self._offset += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        length = self._scalar(10)
        start = self._offset
        self._offset += length
        if self._offset > len(self._buffer):
            raise GGUFFormatError(f"a string of {length} bytes runs past the end of the file")
        return str(self._buffer[start:self._offset], "utf-8")

    def _value(self, kind: int) -> Any:
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            item_kind, count = self._scalar(4), self._scalar(10)
            if item_kind == _STRING:
                return [self._string() for _ in range(count)]
            if item_kind in _NUMPY:
                dtype = np.dtype(_NUMPY[item_kind]).newbyteorder("<")
                values = np.frombuffer(self._buffer, dtype=dtype, count=count, offset=self._offset)
                self._offset += values.nbytes
                return values.tolist()
            return [self._value(item_kind) for _ in range(count)]  # arrays of arrays
        if kind in _SCALARS:
            return self._scalar(kind)
        raise GGUFFormatError(f"unknown metadata value type {kind}")

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        dims = tuple(self._scalar(10) for _ in range(self._scalar(4)))
        return name, dims, self._scalar(4), self._scalar(10)

    def _tensor(self, data_start: int, name: str, dims: tuple[int, ...], kind: int, offset: int) -> Tensor:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import quant_shape_to_byte_shape

        elements = int(np.prod(dims)) if dims else 1
        np_dims = tuple(reversed(dims))
        start = data_start + offset
        if kind in _TYPED:
            dtype = np.dtype(_TYPED[kind])
            count = elements
        else:
            try:
                qtype = GGMLQuantizationType(kind)
            except ValueError as exc:
                raise GGUFFormatError(f"tensor {name} has unknown ggml type {kind}") from exc
            block, type_size = GGML_QUANT_SIZES[qtype]
            dtype, count = np.dtype(np.uint8), elements * type_size // block
            np_dims = quant_shape_to_byte_shape(np_dims, qtype)
        if start + count * dtype.itemsize > len(self._map):
            raise GGUFFormatError(f"tensor {name} runs past the end of the file (truncated download?)")
        data = np.frombuffer(self._map, dtype=dtype, count=count, offset=start).reshape(np_dims)
        return Tensor(name, kind, dims, data)
