"""Fashion-MNIST from the IDX files of Debian's `dataset-fashion-mnist` package (no download)."""
from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import torch

from edgetrain.data.arrays import ArrayStream
from edgetrain.registry import EdgetrainError

FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
_IDX_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: np.dtype(">i2"), 0x0C: np.dtype(">i4"),
               0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}
_FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
          "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}


def parse_idx(data: bytes, source: str = "<bytes>") -> np.ndarray:
    """An IDX array: 2 zero bytes, a dtype code, the number of dims, big-endian uint32 sizes, payload."""
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise EdgetrainError(f"{source}: not an IDX file (bad magic number)")
    code, ndim = data[2], data[3]
    if code not in _IDX_DTYPES:
        raise EdgetrainError(f"{source}: unknown IDX element type 0x{code:02x}")
    if ndim == 0 or len(data) < 4 + 4 * ndim:
        raise EdgetrainError(f"{source}: IDX header truncated or without dimensions")
    shape = tuple(int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim))
    dtype = np.dtype(_IDX_DTYPES[code])
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    payload = data[4 + 4 * ndim:]
    if len(payload) != expected:
        raise EdgetrainError(f"{source}: IDX payload has {len(payload)} bytes, its header {shape} needs {expected}")
    return np.frombuffer(payload, dtype=dtype).reshape(shape)


def read_idx(path: str | Path) -> np.ndarray:
    """Read a plain or gzip-compressed IDX file."""
    path = Path(path)
    try:
        raw = path.read_bytes()
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
    except (OSError, EOFError, gzip.BadGzipFile) as exc:
        raise EdgetrainError(f"{path}: cannot read IDX file ({exc})") from None
    return parse_idx(raw, str(path))


def _find(directory: Path, stem: str) -> Path:
    for name in (stem, stem + ".gz"):
        if (directory / name).is_file():
            return directory / name
    raise EdgetrainError(f"{directory / stem}[.gz] not found: install Debian's package with "
                         "`apt-get install dataset-fashion-mnist`")


def load_fashion_mnist(split: str = "train", *, directory: str | Path = FASHION_MNIST_DIR,
                       image: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    if split not in _FILES:
        raise EdgetrainError(f"split must be 'train' or 'test', got {split!r}")
    directory = Path(directory)
    if not directory.is_dir():
        raise EdgetrainError(f"Fashion-MNIST not found at {directory}: install Debian's package with "
                             "`apt-get install dataset-fashion-mnist`")
    images_name, labels_name = _FILES[split]
    images = read_idx(_find(directory, images_name))
    labels = read_idx(_find(directory, labels_name))
    if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
        raise EdgetrainError(f"{directory}: {split} images {images.shape} and labels {labels.shape} do not match")
    features = torch.from_numpy(images.astype(np.float32) / 255.0)
    features = features.unsqueeze(1) if image else features.reshape(len(features), -1)
    return features, torch.from_numpy(labels.astype(np.int64))


def fashion_mnist_stream(split: str = "train", *, batch_size: int = 32, image: bool = False,
                         directory: str | Path = FASHION_MNIST_DIR, shuffle: bool = True, seed: int = 0,
                         epochs: int | None = None, start_index: int = 0) -> ArrayStream:
    features, labels = load_fashion_mnist(split, directory=directory, image=image)
    return ArrayStream(features, labels, batch_size=batch_size, shuffle=shuffle, seed=seed, epochs=epochs,
                       start_index=start_index)
