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


def read_batch_file(path: str | Path) -> list[Batch]:
    data = Path(path).read_bytes()
    if data[:8] != MAGIC:
        raise EdgetrainError(f"{path}: not an edgetrain batch file (magic {data[:8]!r})")
    offset = 8
    (slots,) = struct.unpack_from("<I", data, offset)
    offset += 4
    specs = []
    for _ in range(slots):
        code, ndim = struct.unpack_from("<II", data, offset)
        offset += 8
        dims = struct.unpack_from(f"<{ndim}q", data, offset)
        offset += 8 * ndim
        if code not in CODE_DTYPES:
            raise EdgetrainError(f"{path}: unknown dtype code {code}")
        specs.append((CODE_DTYPES[code], dims))
    (count,) = struct.unpack_from("<Q", data, offset)
    offset += 8
    batches = []
    for index in range(count):
        tensors = []
        for dtype, dims in specs:
            numel = 1
            for d in dims:
                numel *= d
            nbytes = numel * torch.empty((), dtype=dtype).element_size()
            if offset + nbytes > len(data):
                raise EdgetrainError(f"{path}: truncated at batch {index}")
            tensors.append(torch.frombuffer(bytearray(data[offset:offset + nbytes]), dtype=dtype).reshape(dims))
            offset += nbytes
        batches.append(Batch(tensors[0], tensors[1], index))
    return batches


def read_runner_parameters(path: str | Path) -> dict[str, torch.Tensor]:
    """The parameters the native runner saved, by the model's own names."""
    from safetensors.torch import load_file

    from edgetrain.export.trainable import strip_prefix

    return strip_prefix(load_file(str(path)))
