"""The batch stream file the native runner (targets/executorch/runner.cpp) reads, and its weights file.

Batch stream file, little-endian, every batch the same shape (a program's shapes are fixed at export):

    8 bytes   magic "EDGEBAT1"
    u32       number of tensors per batch (2: inputs, targets)
    per tensor: u32 dtype (0 = float32, 1 = int64), u32 ndim, ndim x i64 dims
    u64       number of batches
    then per batch, per tensor: its elements in C order

The runner writes the trained parameters as a safetensors file (read with `read_runner_parameters`).
"""
from __future__ import annotations

import math
import struct
from pathlib import Path
from typing import Iterable

import torch

from edgetrain.data.batch import Batch
from edgetrain.registry import EdgetrainError
from edgetrain.training.checkpoint import atomic_write_bytes

MAGIC = b"EDGEBAT1"
DTYPE_CODES = {torch.float32: 0, torch.int64: 1}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


def write_batch_file(path: str | Path, batches: Iterable[Batch]) -> Path:
    batches = list(batches)
    if not batches:
        raise EdgetrainError("write_batch_file: no batches")
    first = batches[0]
    slots = [first.inputs, first.targets]
    header = bytearray(MAGIC) + struct.pack("<I", len(slots))
    for tensor in slots:
        if tensor.dtype not in DTYPE_CODES:
            raise EdgetrainError(f"write_batch_file: dtype {tensor.dtype} unsupported (float32 or int64 only)")
        header += struct.pack("<II", DTYPE_CODES[tensor.dtype], tensor.dim())
        header += struct.pack(f"<{tensor.dim()}q", *tensor.shape)
    header += struct.pack("<Q", len(batches))
    body = bytearray()
    for batch in batches:
        for tensor, reference in ((batch.inputs, first.inputs), (batch.targets, first.targets)):
            if tensor.shape != reference.shape or tensor.dtype != reference.dtype:
                raise EdgetrainError(f"write_batch_file: batch {batch.index} has shape {tuple(tensor.shape)} "
                                     f"{tensor.dtype}, batch {first.index} {tuple(reference.shape)} "
                                     f"{reference.dtype}; every batch must match")
            body += tensor.detach().cpu().contiguous().numpy().tobytes()
    return atomic_write_bytes(bytes(header + body), path)


class BatchFileError(EdgetrainError):
    """A batch file that is missing, truncated, damaged or not one (names the file and what is wrong)."""


def read_batch_file(path: str | Path) -> list[Batch]:
    """Every batch of a batch file, refused (BatchFileError) unless the file holds exactly what its header says:
    the native runners read the same files with the same checks."""
    from edgetrain.files.user import require_regular_file

    path = require_regular_file(path, BatchFileError, "the batch file")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise BatchFileError(f"{path}: cannot read the batch file ({exc.strerror or exc})") from None
    if data[:8] != MAGIC:
        raise BatchFileError(f"{path}: not an edgetrain batch file (magic {data[:8]!r})")
    try:
        offset = 8
        (slots,) = struct.unpack_from("<I", data, offset)
        offset += 4
        if slots != 2:
            raise BatchFileError(f"{path}: the header says {slots} tensors per batch; a batch file holds 2 "
                                 "(inputs, targets)")
        specs = []
        for _ in range(slots):
            code, ndim = struct.unpack_from("<II", data, offset)
            offset += 8
            if code not in CODE_DTYPES:
                raise BatchFileError(f"{path}: the header names an unknown dtype code {code}")
            if ndim > 8:
                raise BatchFileError(f"{path}: the header gives a tensor {ndim} dimensions")
            dims = struct.unpack_from(f"<{ndim}q", data, offset)
            offset += 8 * ndim
            if any(d < 0 for d in dims):
                raise BatchFileError(f"{path}: the header gives a negative dimension {dims}")
            specs.append((CODE_DTYPES[code], dims, math.prod(dims) * torch.empty((), dtype=CODE_DTYPES[code])
                          .element_size()))
        (count,) = struct.unpack_from("<Q", data, offset)
        offset += 8
    except struct.error:
        raise BatchFileError(f"{path}: the batch file's header is truncated ({len(data)} bytes)") from None
    batch_bytes = sum(nbytes for _, _, nbytes in specs)
    if batch_bytes == 0:
        raise BatchFileError(f"{path}: the header describes empty batches")
    if count == 0:
        raise BatchFileError(f"{path}: the batch file holds no batches")
    available = len(data) - offset
    if available < count * batch_bytes:
        raise BatchFileError(f"{path}: truncated: the header announces {count} batches of {batch_bytes} bytes, "
                             f"the file holds {available}")
    if available != count * batch_bytes:
        raise BatchFileError(f"{path}: {available - count * batch_bytes} bytes past the {count} batches its header "
                             "announces: damaged")
    batches = []
    for index in range(count):
        tensors = []
        for dtype, dims, nbytes in specs:
            tensors.append(torch.frombuffer(bytearray(data[offset:offset + nbytes]), dtype=dtype).reshape(dims))
            offset += nbytes
        batches.append(Batch(tensors[0], tensors[1], index))
    return batches


def read_runner_parameters(path: str | Path) -> dict[str, torch.Tensor]:
    """The parameters the native runner saved, by the model's own names."""
    from safetensors.torch import load_file

    from edgetrain.export.trainable import strip_prefix

    return strip_prefix(load_file(str(path)))
