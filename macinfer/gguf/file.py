"""The GGUF container: header, metadata and tensor table, checked before use.

A partial download is the most common broken model file, so the whole layout
is validated up front (magic, version, every tensor inside the file, known
tensor types) and any problem becomes one `ModelLoadError` line naming the file.
Tensor data is read through a memory map, one tensor at a time.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np


class ModelLoadError(ValueError):
    """A model file that exists but cannot be used (truncated, corrupt, unsupported)."""


# GGUF metadata value types.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NP = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
       7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9


@dataclass
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order (outermost first)
    type_id: int
    offset: int  # absolute, in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        from gguf import GGMLQuantizationType

        try:
            return GGMLQuantizationType(self.type_id).name
        except ValueError:
            return f"type {self.type_id}"


class _Cursor:
    def __init__(self, buf: memoryview):
        self.buf, self.pos = buf, 0

    def take(self, n: int) -> memoryview:
        if self.pos + n > len(self.buf):
            raise EOFError
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        return bytes(self.take(self.unpack("<Q"))).decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            itype, count = self.unpack("<I"), self.unpack("<Q")
            if itype in _NP:
                dt = np.dtype(_NP[itype]).newbyteorder("<")
                return np.frombuffer(self.take(count * dt.itemsize), dtype=dt).copy()
            return [self.value(itype) for _ in range(count)]
        raise ValueError(f"unknown metadata value type {vtype}")


class GGUFFile:
    """Metadata and tensor table of one GGUF file, validated against its size."""

    def __init__(self, path: str):
        self.path = path
        name = os.path.basename(path)
        size = os.path.getsize(path)
        if size < 24:
            raise ModelLoadError(f"{name}: not a GGUF file ({size} bytes)")
        self._map = np.memmap(path, dtype=np.uint8, mode="r")
        cur = _Cursor(memoryview(self._map))
        if bytes(cur.take(4)) != b"GGUF":
            raise ModelLoadError(f"{name}: not a GGUF file (bad magic bytes)")
        version = cur.unpack("<I")
        if version not in (2, 3):
            raise ModelLoadError(f"{name}: unsupported GGUF version {version} (2 and 3 are supported)")
        try:
            n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
            self.metadata: dict[str, Any] = {}
            for _ in range(n_kv):
                key = cur.string()
                self.metadata[key] = cur.value(cur.unpack("<I"))
            infos = []
            for _ in range(n_tensors):
                tname = cur.string()
                dims = [cur.unpack("<Q") for _ in range(cur.unpack("<I"))]
                infos.append((tname, tuple(reversed(dims)), cur.unpack("<I"), cur.unpack("<Q")))
        except (EOFError, struct.error, ValueError, OverflowError, MemoryError):
            raise ModelLoadError(
                f"{name}: truncated or corrupt GGUF header ({size} bytes): re-download the file"
            ) from None
        align = self.metadata.get("general.alignment", 32)
        if type(align) is not int or align <= 0 or align & (align - 1):
            raise ModelLoadError(f"{name}: general.alignment {align!r} is not a power of two")
        data_start = (cur.pos + align - 1) // align * align
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        self.tensors: dict[str, TensorInfo] = {}
        end = data_start
        for tname, shape, type_id, offset in infos:
            try:
                block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]
            except (ValueError, KeyError):
                raise ModelLoadError(f"{name}: tensor {tname} has unknown GGML type {type_id}") from None
            count = int(np.prod(shape, dtype=np.int64))
            if count % block:
                raise ModelLoadError(f"{name}: tensor {tname} of shape {shape} is not whole blocks")
            info = TensorInfo(tname, shape, type_id, data_start + offset, count // block * type_size)
            self.tensors[tname] = info
            end = max(end, info.offset + info.nbytes)
        if end > size:
            raise ModelLoadError(
                f"{name}: truncated GGUF file ({size:,} bytes, its tensors need {end:,}): "
                "the download is incomplete; download it again"
            )

    def types(self) -> set[str]:
        return {t.type_name for t in self.tensors.values()}

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes (a view into the memory map)."""
        t = self.tensors[name]
        return self._map[t.offset : t.offset + t.nbytes]

    def dequantize(self, name: str) -> np.ndarray:
        """The tensor as float32 (float16/bfloat16 widened), via llama.cpp's own gguf package."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        t = self.tensors[name]
        qtype = GGMLQuantizationType(t.type_id)
        if qtype == GGMLQuantizationType.F32:
            return self.raw(name).view(np.float32).reshape(t.shape)
        if qtype == GGMLQuantizationType.F16:
            return self.raw(name).view(np.float16).reshape(t.shape)
        rows = self.raw(name).reshape(int(np.prod(t.shape[:-1], dtype=np.int64)) or 1, -1)
        return dequantize(rows, qtype).reshape(t.shape)
