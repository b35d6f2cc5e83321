"""The weights file beside a MeSP training program: named tensors a native runner memory-maps, with a checksum.

The block programs take their frozen weights as inputs, so the weights live in this file, not in the
program; the runner maps it and hands the program pointers into the mapping (only the pages a step reads
become resident, and they are clean file pages the kernel can drop). Little-endian:

    8 bytes   magic "EDGEWTS1"
    u32       crc32 of everything after this field (header and data: a damaged byte anywhere is found)
    u32       number of tensors
    u64       manifest length, then the manifest (UTF-8 JSON, for Python and people: what the program is)
    per tensor: u32 name length, the name (UTF-8), u32 dtype code, u32 ndim, ndim x i64 dims,
                u64 offset of its data from the start of the file, u64 its length in bytes
    the data, each tensor at a multiple of ALIGNMENT bytes

Dtype codes: 0 float32, 1 int64, 2 uint8, 3 float16 (what a GGUF's packed blocks need), 4 int8 (packed codes
as a MeSP program reads them: edgetrain/export/mesp_graph.py, MatrixFormat).
"""
from __future__ import annotations

import json
import math
import mmap
import struct
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from edgetrain.files.atomic import atomic_write_file
from edgetrain.registry import EdgetrainError

MAGIC = b"EDGEWTS1"
ALIGNMENT = 64
DTYPE_CODES = {torch.float32: 0, torch.int64: 1, torch.uint8: 2, torch.float16: 3, torch.int8: 4}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}
_NUMPY = {torch.float32: np.float32, torch.int64: np.int64, torch.uint8: np.uint8, torch.float16: np.float16,
          torch.int8: np.int8}
_MAX_HEADER = 1 << 26  # a header this large is damage, not a model


class WeightsFileError(EdgetrainError):
    """A weights file that is missing, truncated, damaged or not one (names the file and what is wrong)."""


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def _aligned(offset: int) -> int:
    return -(-offset // ALIGNMENT) * ALIGNMENT


def _header(manifest: dict[str, Any], tensors: dict[str, torch.Tensor]) -> tuple[bytes, list[TensorEntry]]:
    manifest_bytes = json.dumps(manifest, sort_keys=True).encode()
    specs = []
    for name, tensor in tensors.items():
        if tensor.dtype not in DTYPE_CODES:
            raise WeightsFileError(f"weights file: tensor {name} is {tensor.dtype}; the format holds "
                                   f"{', '.join(str(d) for d in DTYPE_CODES)}")
        specs.append((name.encode(), tensor))
    size = 8 + 4 + 4 + 8 + len(manifest_bytes)
    size += sum(4 + len(name) + 4 + 4 + 8 * tensor.dim() + 16 for name, tensor in specs)
    offset, entries = _aligned(size), []
    for name, tensor in specs:
        nbytes = tensor.numel() * tensor.element_size()
        entries.append(TensorEntry(name.decode(), tensor.dtype, tuple(tensor.shape), offset, nbytes))
        offset = _aligned(offset + nbytes)
    body = bytearray(struct.pack("<IQ", len(entries), len(manifest_bytes)) + manifest_bytes)
    for entry in entries:
        name = entry.name.encode()
        body += struct.pack(f"<I{len(name)}sII", len(name), name, DTYPE_CODES[entry.dtype], len(entry.shape))
        body += struct.pack(f"<{len(entry.shape)}qQQ", *entry.shape, entry.offset, entry.nbytes)
    return bytes(body), entries


def weights_file_bytes(tensors: dict[str, torch.Tensor], manifest: dict[str, Any]) -> int:
    """The size of the weights file of `tensors` and `manifest`, known before any of it is written (from the
    header alone: no tensor is copied)."""
    body, entries = _header(manifest, tensors)
    return max([8 + 4 + len(body)] + [entry.offset + entry.nbytes for entry in entries])


def write_weights_file(path: str | Path, tensors: dict[str, torch.Tensor], manifest: dict[str, Any]) -> Path:
    """Write `tensors` (in this order) and `manifest` crash-safe: the old file stays until the new one is whole,
    and a disk without room for it is refused (DiskFullError) before anything is written."""
    body, entries = _header(manifest, tensors)
    chunks: list[bytes] = [body]
    position = 8 + 4 + len(body)
    for entry, tensor in zip(entries, tensors.values()):
        chunks.append(b"\0" * (entry.offset - position))
        data = tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
        chunks.append(data)
        position = entry.offset + len(data)
    crc = 0
    for chunk in chunks:
        crc = zlib.crc32(chunk, crc)

    def write(temp_path: Path) -> None:
        with open(temp_path, "wb") as handle:
            handle.write(MAGIC + struct.pack("<I", crc))
            for chunk in chunks:
                handle.write(chunk)

    return atomic_write_file(path, write, needed=8 + 4 + sum(len(chunk) for chunk in chunks))


class WeightsFile:
    """A weights file mapped read-only: `tensor(name)` is a view into the mapping (no copy)."""

    def __init__(self, path: str | Path, verify: bool = True) -> None:
        from edgetrain.files.user import require_regular_file

        self.path = require_regular_file(path, WeightsFileError, "the weights file")
        try:
            handle = open(self.path, "rb")
        except OSError as exc:
            raise WeightsFileError(f"{self.path}: cannot open the weights file: {exc.strerror or exc}") from exc
        with handle:
            size = self.path.stat().st_size
            if size < 24:
                raise WeightsFileError(f"{self.path}: {size} bytes is too short for a weights file")
            self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        if self._map[:8] != MAGIC:
            raise WeightsFileError(f"{self.path}: not an edgetrain weights file (magic {bytes(self._map[:8])!r})")
        (stored_crc,) = struct.unpack_from("<I", self._map, 8)
        if verify and zlib.crc32(memoryview(self._map)[12:]) != stored_crc:
            raise WeightsFileError(f"{self.path}: the checksum does not match: the file is damaged or truncated")
        self.manifest, self.entries = self._parse(size)

    def _parse(self, size: int) -> tuple[dict[str, Any], dict[str, TensorEntry]]:
        try:
            count, manifest_length = struct.unpack_from("<IQ", self._map, 12)
            if manifest_length > _MAX_HEADER:
                raise ValueError(f"manifest of {manifest_length} bytes")
            offset = 24
            manifest = json.loads(bytes(self._map[offset:offset + manifest_length]).decode())
            offset += manifest_length
            entries: dict[str, TensorEntry] = {}
            for _ in range(count):
                (name_length,) = struct.unpack_from("<I", self._map, offset)
                name = bytes(self._map[offset + 4:offset + 4 + name_length]).decode()
                offset += 4 + name_length
                code, ndim = struct.unpack_from("<II", self._map, offset)
                offset += 8
                if ndim > 8:
                    raise ValueError(f"tensor {name}: {ndim} dimensions")
                *shape, data_offset, nbytes = struct.unpack_from(f"<{ndim}qQQ", self._map, offset)
                offset += 8 * ndim + 16
                dtype = CODE_DTYPES[code]
                element = torch.empty((), dtype=dtype).element_size()
                # Python's exact product: numpy's int64 one wraps, and a huge shape over 0 bytes would pass.
                expected = math.prod(shape) * element
                if (min(shape, default=0) < 0 or nbytes != expected or data_offset + nbytes > size
                        or data_offset % element):
                    raise ValueError(f"tensor {name}: shape {shape}, {nbytes} bytes at {data_offset}")
                entries[name] = TensorEntry(name, dtype, tuple(shape), data_offset, nbytes)
        except (struct.error, KeyError, ValueError, UnicodeDecodeError) as exc:
            raise WeightsFileError(f"{self.path}: the header is damaged ({type(exc).__name__}: {exc})") from exc
        return manifest, entries

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def tensor(self, name: str) -> torch.Tensor:
        entry = self.entries.get(name)
        if entry is None:
            raise WeightsFileError(f"{self.path}: no tensor {name!r}")
        if entry.nbytes == 0:
            return torch.empty(entry.shape, dtype=entry.dtype)
        array = np.frombuffer(self._map, dtype=_NUMPY[entry.dtype], count=int(np.prod(entry.shape, dtype=np.int64)),
                              offset=entry.offset)
        # The mapping is read-only and torch warns about non-writable arrays; the programs only read their inputs.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(array).view(entry.shape)
