"""Reading and writing the safetensors format with plain numpy.

A safetensors file is an 8-byte little-endian header length, a JSON header
({name: {dtype, shape, data_offsets}}, optional "__metadata__"), then raw tensor bytes.
Reading memory-maps the file and hands out views, so opening a checkpoint costs only
its headers. Done here rather than with `safetensors.numpy` because that cannot read
bfloat16, the dtype most published checkpoints use (numpy gets it from `ml_dtypes`).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np

from checkpoints.base import CheckpointError

_NUMPY_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U64": np.uint64,
    "U32": np.uint32,
    "U16": np.uint16,
    "U8": np.uint8,
    "BOOL": np.bool_,
}
_ML_DTYPES = {"BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
_HEADER_LIMIT = 100 * 1024 * 1024  # the format's own cap on the JSON header


def _dtype(name: str) -> np.dtype | None:
    if name in _NUMPY_DTYPES:
        return np.dtype(_NUMPY_DTYPES[name])
    if name in _ML_DTYPES:
        import ml_dtypes  # a jax dependency; imported only when a file needs it

        return np.dtype(getattr(ml_dtypes, _ML_DTYPES[name]))
    return None


def _dtype_name(dtype: np.dtype) -> str:
    for name, np_type in _NUMPY_DTYPES.items():
        if dtype == np.dtype(np_type):
            return name
    for name, ml_name in _ML_DTYPES.items():
        if dtype.name == ml_name:
            return name
    raise ValueError(f"dtype {dtype} has no safetensors name")


class SafetensorsFile:
    """One memory-mapped .safetensors file; `get(name)` returns a view into the map."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                prefix = f.read(8)
                if len(prefix) < 8:
                    raise CheckpointError(
                        f"{self.path}: not a safetensors file (shorter than its 8-byte header length)"
                    )
                header_len = int.from_bytes(prefix, "little")
                if header_len > min(_HEADER_LIMIT, size - 8):
                    raise CheckpointError(
                        f"{self.path}: corrupt or truncated safetensors file "
                        f"(header of {header_len} bytes, file of {size})"
                    )
                header = json.loads(f.read(header_len))
        except OSError as e:
            raise CheckpointError(f"{self.path}: cannot read safetensors file: {e}") from e
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{self.path}: corrupt safetensors header: {e}") from e
        if not isinstance(header, dict):
            raise CheckpointError(f"{self.path}: corrupt safetensors header (not a JSON object)")
        self.metadata: dict = header.pop("__metadata__", None) or {}
        self._entries: dict[str, tuple[np.dtype, tuple[int, ...], int, int]] = {}
        data_start = 8 + header_len
        for name, entry in header.items():
            self._entries[name] = self._check_entry(name, entry, size - data_start)
        self._data_start = data_start
        self._map: np.memmap | None = None

    def _check_entry(self, name: str, entry, data_size: int):
        try:
            dtype = _dtype(entry["dtype"])
            shape = tuple(int(d) for d in entry["shape"])
            begin, end = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{self.path}: corrupt header entry for tensor {name!r}: {entry!r}") from e
        if dtype is None:
            raise CheckpointError(f"{self.path}: tensor {name!r} has unsupported dtype {entry['dtype']!r}")
        if end - begin != math.prod(shape) * dtype.itemsize or begin < 0:
            raise CheckpointError(f"{self.path}: tensor {name!r}: offsets {begin}..{end} do not fit {shape} {dtype}")
        if end > data_size:
            raise CheckpointError(
                f"{self.path}: truncated safetensors file: tensor {name!r} ends at byte {end} of a "
                f"{data_size}-byte data section"
            )
        return dtype, shape, begin, end

    def keys(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def get(self, name: str) -> np.ndarray:
        dtype, shape, begin, end = self._entries[name]
        if begin == end:
            return np.zeros(shape, dtype)
        if self._map is None:
            # Copy-on-write: callers may modify their arrays without touching the file.
            self._map = np.memmap(self.path, dtype=np.uint8, mode="c")
        start = self._data_start + begin
        return self._map[start : self._data_start + end].view(dtype).reshape(shape)


class LazyTensors(Mapping[str, np.ndarray]):
    """Tensor name -> array, read from memory-mapped safetensors files on access."""

    def __init__(self, locations: Mapping[str, SafetensorsFile]):
        self._locations = dict(locations)

    def __getitem__(self, name: str) -> np.ndarray:
        return self._locations[name].get(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._locations)

    def __len__(self) -> int:
        return len(self._locations)

    def __repr__(self) -> str:
        return f"LazyTensors({len(self)} tensors)"


def save_safetensors(
    path: str | os.PathLike, tensors: Mapping[str, np.ndarray], metadata: dict[str, str] | None = None
):
    """Write tensors to one .safetensors file, streaming (no second copy in memory), fsynced."""
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    arrays = {}
    for name, array in tensors.items():
        array = np.ascontiguousarray(array)
        arrays[name] = array
        header[name] = {
            "dtype": _dtype_name(array.dtype),
            "shape": list(array.shape),
            "data_offsets": [offset, offset + array.nbytes],
        }
        offset += array.nbytes
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)  # align the data section to 8 bytes
    with open(path, "wb") as f:
        f.write(len(header_bytes).to_bytes(8, "little"))
        f.write(header_bytes)
        for array in arrays.values():
            f.write(array.reshape(-1).view(np.uint8).data)
        f.flush()
        os.fsync(f.fileno())
