"""Reading a GGUF file (llama.cpp's model format, v2/v3, little-endian) without trusting it.

The header, metadata and tensor table are parsed from a read-only memory map; every length, count and
offset is checked against the file size before anything is allocated, so a damaged or hostile file
is refused with a GGUFError naming the file and the byte offset, never a MemoryError or struct.error.
Tensor bytes stay in the map until a loader asks for them (`tensor_bytes`).
"""
from __future__ import annotations

import mmap
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, overload

import numpy as np

from edgetrain.files.user import require_regular_file
from edgetrain.models.gguf.ggml_types import GGML_TYPES, ggml_type_name
from edgetrain.models.hf_checkpoint import CheckpointError

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)  # v1 counted in 32 bits and is long gone from the wild
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
_MAX_ARRAY_DEPTH = 4  # the spec allows arrays of arrays; nothing real nests deeper than two

# GGUF metadata value types.
_STRING, _ARRAY = 8, 9
_SCALARS = {0: ("<B", "uint8"), 1: ("<b", "int8"), 2: ("<H", "uint16"), 3: ("<h", "int16"),
            4: ("<I", "uint32"), 5: ("<i", "int32"), 6: ("<f", "float32"), 7: ("<?", "bool"),
            10: ("<Q", "uint64"), 11: ("<q", "int64"), 12: ("<d", "float64")}
# The least bytes one entry of each kind can take: what a count is checked against before a loop.
_MIN_STRING = 8
_MIN_ARRAY = 4 + 8
_MIN_KV = 8 + 4 + 1
_MIN_TENSOR_INFO = 8 + 4 + 8 + 4 + 8


class GGUFError(CheckpointError):
    """A GGUF file that is damaged, hostile, or describes a model edgetrain cannot load."""


class StringArray(Sequence[str]):
    """A metadata array of strings kept as the file's bytes, each item decoded when read (every one was
    checked to be UTF-8 when the file was read).

    A vocabulary is ~50k strings, its merges as many: as Python objects they take ~10 MiB while the file is
    read, and after they are freed, the few objects made beside them keep some of the interpreter's 1 MiB
    arenas (3 MiB for SmolLM2's), for the life of the process. Read one at a time, each string is freed
    before the next is made."""

    def __init__(self, blob: bytes, ends: np.ndarray) -> None:
        self._blob = blob  # the array as stored: each item's u64 length, then its bytes
        self._ends = ends  # int64: where each item's bytes end in blob; they begin 8 bytes after the last's

    def __len__(self) -> int:
        return len(self._ends)

    def _item(self, index: int) -> str:
        start = (int(self._ends[index - 1]) if index else 0) + 8
        return self._blob[start:int(self._ends[index])].decode("utf-8")

    @overload
    def __getitem__(self, index: int) -> str: ...
    @overload
    def __getitem__(self, index: slice) -> list[str]: ...

    def __getitem__(self, index: int | slice) -> str | list[str]:
        if isinstance(index, slice):
            return [self._item(i) for i in range(*index.indices(len(self)))]
        count = len(self)
        if not -count <= index < count:
            raise IndexError(f"index {index} is out of range for {count} strings")
        return self._item(index % count)

    def __iter__(self) -> Iterator[str]:
        return (self._item(i) for i in range(len(self)))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)) or len(other) != len(self):
            return False
        return all(a == b for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment]  # a list-like compares by value

    def __repr__(self) -> str:
        shown = ", ".join(repr(item) for item in self[:3])
        return f"StringArray([{shown}{', ...' if len(self) > 3 else ''}], {len(self)} strings)"


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order (GGUF lists dimensions fastest-varying first)
    ggml_type: int
    offset: int  # absolute, from the start of the file
    nbytes: int

    @property
    def type_name(self) -> str:
        return ggml_type_name(self.ggml_type)


@dataclass
class GGUFFile:
    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    data_start: int
    _data: np.ndarray  # the read-only map of the whole file
    _map: Any = None   # the mmap behind _data (release() advises it)

    def tensor_bytes(self, info: TensorInfo) -> np.ndarray:
        """The raw bytes of one tensor: a uint8 view into the map (offsets were checked when read)."""
        return self._data[info.offset:info.offset + info.nbytes]

    def release(self, info: TensorInfo) -> None:
        """Drop the tensor's pages from this process's resident set once a loader has copied what it needs
        (they stay in the OS page cache; a later read faults them back in). Without it, loading a model maps
        every byte of the file into the resident set beside the weights made from it: a packed SmolLM2
        would peak at twice its 93 MB."""
        advise = getattr(self._map, "madvise", None)
        if advise is None or not hasattr(mmap, "MADV_DONTNEED"):
            return  # a platform without madvise keeps the pages until the map is closed
        start = info.offset - info.offset % mmap.PAGESIZE
        advise(mmap.MADV_DONTNEED, start, info.offset + info.nbytes - start)


class _Cursor:
    """Sequential little-endian reads over the map; every read is bounds-checked against the file end."""

    def __init__(self, data: memoryview, path: Path) -> None:
        self.data = data
        self.size = len(data)
        self.pos = 0
        self.path = path

    def fail(self, why: str, at: int | None = None) -> GGUFError:
        return GGUFError(f"{self.path}: {why} (at byte offset {self.pos if at is None else at})")

    @property
    def remaining(self) -> int:
        return self.size - self.pos

    def take(self, count: int, what: str) -> memoryview:
        if count > self.remaining:
            raise self.fail(f"truncated: {what} needs {count} bytes but the file ends "
                            f"{self.remaining} bytes later (file size {self.size})")
        chunk = self.data[self.pos:self.pos + count]
        self.pos += count
        return chunk

    def scalar(self, fmt: str, what: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def u32(self, what: str) -> int:
        return self.scalar("<I", what)

    def u64(self, what: str) -> int:
        return self.scalar("<Q", what)

    def string(self, what: str) -> str:
        """One length-prefixed string, checked to be UTF-8."""
        start = self.pos
        length = self.u64(f"the length of {what}")
        if length > self.remaining:
            raise self.fail(f"{what} claims {length} bytes but only {self.remaining} remain in the file", start)
        raw = self.take(length, what)
        try:
            return bytes(raw).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.fail(f"{what} is not valid UTF-8 ({exc.reason} at byte {exc.start})", start) from None

    def string_array(self, count: int, key: str) -> StringArray:
        """`count` strings, each checked as string() checks it, kept as the file's bytes (StringArray)."""
        first = self.pos
        ends = np.empty(count, dtype=np.int64)  # 8 bytes per item, each of which takes 8 or more in the file
        for index in range(count):
            self.string(f"element {index} of array {key!r}")  # checked, then dropped
            ends[index] = self.pos - first
        return StringArray(bytes(self.data[first:self.pos]), ends)

    def count(self, what: str, least_bytes_each: int, read: Any = None) -> int:
        """A u64 count of entries that each take at least `least_bytes_each`: refused before any loop
        or allocation when the rest of the file could not hold that many."""
        start = self.pos
        count = (read or self.u64)(what)
        if count * least_bytes_each > self.remaining:
            raise self.fail(f"{what} is {count}, more than the remaining {self.remaining} bytes of the file "
                            "can hold", start)
        return count


def _read_value(cursor: _Cursor, value_type: int, key: str, depth: int = 0) -> Any:
    if value_type in _SCALARS:
        fmt, _ = _SCALARS[value_type]
        return cursor.scalar(fmt, f"the value of {key!r}")
    if value_type == _STRING:
        return cursor.string(f"the string value of {key!r}")
    if value_type != _ARRAY:
        raise cursor.fail(f"metadata key {key!r} has unknown value type {value_type}", cursor.pos - 4)
    if depth >= _MAX_ARRAY_DEPTH:
        raise cursor.fail(f"metadata key {key!r} nests arrays more than {_MAX_ARRAY_DEPTH} deep")
    element_type = cursor.u32(f"the element type of array {key!r}")
    if element_type in _SCALARS:
        fmt, numpy_name = _SCALARS[element_type]
        width = struct.calcsize(fmt)
        count = cursor.count(f"the element count of array {key!r}", width)
        raw = cursor.take(count * width, f"the elements of array {key!r}")
        dtype = np.dtype(numpy_name).newbyteorder("<") if width > 1 else np.dtype(numpy_name)
        return np.frombuffer(raw, dtype=dtype).astype(np.dtype(numpy_name))  # a native-order copy
    if element_type == _STRING:
        count = cursor.count(f"the element count of array {key!r}", _MIN_STRING)
        return cursor.string_array(count, key)
    if element_type == _ARRAY:
        count = cursor.count(f"the element count of array {key!r}", _MIN_ARRAY)
        return [_read_value(cursor, _ARRAY, f"{key}[{i}]", depth + 1) for i in range(count)]
    raise cursor.fail(f"array {key!r} has unknown element type {element_type}", cursor.pos - 4)


def _read_metadata(cursor: _Cursor) -> dict[str, Any]:
    count = cursor.count("the metadata key count", _MIN_KV)
    metadata: dict[str, Any] = {}
    for index in range(count):
        start = cursor.pos
        key = cursor.string(f"metadata key {index}")
        value_type = cursor.u32(f"the value type of {key!r}")
        value = _read_value(cursor, value_type, key)
        if key in metadata:
            raise cursor.fail(f"metadata key {key!r} appears twice", start)
        metadata[key] = value
    return metadata


def _alignment(metadata: dict[str, Any], path: Path) -> int:
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment <= 0 \
            or alignment & (alignment - 1):
        raise GGUFError(f"{path}: general.alignment = {alignment!r} is not a positive power of two")
    return alignment


def _read_tensor_infos(cursor: _Cursor, tensor_count: int) -> list[tuple[str, tuple[int, ...], int, int, int]]:
    infos = []
    for index in range(tensor_count):
        start = cursor.pos
        name = cursor.string(f"the name of tensor {index}")
        n_dims = cursor.u32(f"the dimension count of tensor {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise cursor.fail(f"tensor {name!r} has {n_dims} dimensions; GGUF allows 1..{MAX_DIMS}", start)
        dims = tuple(cursor.u64(f"dimension {d} of tensor {name!r}") for d in range(n_dims))
        if any(d == 0 for d in dims):
            raise cursor.fail(f"tensor {name!r} has an empty dimension {list(dims)}", start)
        ggml_type = cursor.u32(f"the ggml type of tensor {name!r}")
        if ggml_type not in GGML_TYPES:
            raise cursor.fail(f"tensor {name!r} has unknown ggml type {ggml_type}", start)
        offset = cursor.u64(f"the data offset of tensor {name!r}")
        infos.append((name, dims, ggml_type, offset, start))
    return infos


def _tensor_nbytes(name: str, dims: tuple[int, ...], ggml_type: int, path: Path) -> int:
    block_size, block_bytes = GGML_TYPES[ggml_type][1:]
    if dims[0] % block_size:
        raise GGUFError(f"{path}: tensor {name!r} ({ggml_type_name(ggml_type)}) has rows of {dims[0]} values, "
                        f"not a multiple of its block size {block_size}")
    elements = 1
    for d in dims:
        elements *= d  # Python ints: a hostile product cannot overflow, only fail the size check below
    return elements // block_size * block_bytes


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse a GGUF file's header, metadata and tensor table (tensor data is mapped, not read)."""
    path = require_regular_file(path, GGUFError, "the GGUF file")
    size = path.stat().st_size
    if size == 0:
        raise GGUFError(f"{path}: empty file, not a GGUF model")
    try:
        with open(path, "rb") as handle:
            mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        data = np.frombuffer(mapped, dtype=np.uint8)
    except (OSError, ValueError) as exc:
        raise GGUFError(f"{path}: cannot map the GGUF file ({exc})") from None
    cursor = _Cursor(memoryview(data), path)
    magic = bytes(cursor.take(4, "the magic number"))
    if magic != GGUF_MAGIC:
        raise GGUFError(f"{path}: not a GGUF file (magic {magic!r} at byte offset 0, expected b'GGUF')")
    version = cursor.u32("the version")
    if version not in SUPPORTED_VERSIONS:
        swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
        hint = " (a big-endian GGUF? edgetrain reads little-endian files only)" if swapped in SUPPORTED_VERSIONS else ""
        raise GGUFError(f"{path}: unsupported GGUF version {version} at byte offset 4{hint}; "
                        f"supported: {', '.join(map(str, SUPPORTED_VERSIONS))}")
    tensor_count = cursor.count("the tensor count", _MIN_TENSOR_INFO)
    metadata = _read_metadata(cursor)
    alignment = _alignment(metadata, path)
    raw_infos = _read_tensor_infos(cursor, tensor_count)
    data_start = -(-cursor.pos // alignment) * alignment
    tensors: dict[str, TensorInfo] = {}
    for name, dims, ggml_type, offset, info_at in raw_infos:
        if name in tensors:
            raise GGUFError(f"{path}: tensor {name!r} appears twice in the tensor table (byte offset {info_at})")
        if offset % alignment:
            raise GGUFError(f"{path}: tensor {name!r} data offset {offset} is not a multiple of the "
                            f"alignment {alignment}")
        nbytes = _tensor_nbytes(name, dims, ggml_type, path)
        if data_start + offset + nbytes > size:
            raise GGUFError(f"{path}: tensor {name!r} data ({nbytes} bytes at byte offset {data_start + offset}) "
                            f"runs past the end of the file (size {size})")
        tensors[name] = TensorInfo(name, tuple(reversed(dims)), ggml_type, data_start + offset, nbytes)
    return GGUFFile(path, version, metadata, tensors, data_start, data, mapped)
