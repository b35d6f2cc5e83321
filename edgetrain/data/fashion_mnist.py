"""Fashion-MNIST from the IDX files of Debian's `dataset-fashion-mnist` package (no download).

The package installs gzip-compressed files under /usr/share/datasets/fashion-mnist:
train-images-idx3-ubyte.gz (60,000 x 28 x 28), train-labels-idx1-ubyte.gz, t10k-images-idx3-ubyte.gz
(10,000 x 28 x 28) and t10k-labels-idx1-ubyte.gz. Uncompressed copies (no .gz) are read as well.
"""
from __future__ import annotations

import gzip
import math
import zlib
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from edgetrain.data.arrays import ArrayStream, keep_classes
from edgetrain.registry import EdgetrainError

FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_MNIST_PACKAGE = "dataset-fashion-mnist"
FASHION_MNIST_CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker",
                         "Bag", "Ankle boot")
FASHION_MNIST_FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
                       "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}

# The element type codes of the IDX format; multi-byte values are big-endian.
_IDX_DTYPES = {0x08: np.dtype(np.uint8), 0x09: np.dtype(np.int8), 0x0B: np.dtype(">i2"), 0x0C: np.dtype(">i4"),
               0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}
_GZIP_MAGIC = b"\x1f\x8b"


def parse_idx(data: bytes, source: str = "<bytes>") -> np.ndarray:
    """An IDX array from its bytes: magic 0x00 0x00, a dtype code, the number of dims, one big-endian
    uint32 size per dim, then exactly prod(sizes) elements. Any mismatch raises EdgetrainError naming
    `source`."""
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise EdgetrainError(f"{source}: not an IDX file (bad magic number {data[:4].hex() or 'empty'})")
    code, ndim = data[2], data[3]
    if code not in _IDX_DTYPES:
        raise EdgetrainError(f"{source}: unknown IDX element type 0x{code:02x}")
    if ndim == 0:
        raise EdgetrainError(f"{source}: IDX header declares 0 dimensions")
    header_size = 4 + 4 * ndim
    if len(data) < header_size:
        raise EdgetrainError(f"{source}: IDX header truncated ({len(data)} bytes, {ndim} dims need {header_size})")
    shape = tuple(int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim))
    dtype = _IDX_DTYPES[code]
    expected = math.prod(shape) * dtype.itemsize  # Python ints: a huge header cannot overflow
    payload_size = len(data) - header_size
    if payload_size != expected:
        raise EdgetrainError(f"{source}: IDX payload has {payload_size} bytes, its header {shape} x "
                             f"{dtype.itemsize} needs {expected} (truncated or damaged file)")
    # Native byte order, so torch.from_numpy accepts the result.
    return np.frombuffer(data, dtype=dtype, offset=header_size).reshape(shape).astype(dtype.newbyteorder("="))


def read_idx(path: str | Path) -> np.ndarray:
    """Read a plain or gzip-compressed IDX file (detected by content, not by name)."""
    path = Path(path)
    try:
        raw = path.read_bytes()
        if raw[:2] == _GZIP_MAGIC:
            raw = gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as exc:  # gzip.BadGzipFile is an OSError
        raise EdgetrainError(f"{path}: cannot read IDX file ({exc})") from None
    return parse_idx(raw, str(path))


def _missing_package_message(what: Path) -> str:
    return (f"Fashion-MNIST not found at {what}: it comes from Debian's package {FASHION_MNIST_PACKAGE}; "
            f"install it with `apt-get install {FASHION_MNIST_PACKAGE}`")


def _find_idx(directory: Path, stem: str) -> Path:
    for name in (stem + ".gz", stem):
        if (directory / name).is_file():
            return directory / name
    raise EdgetrainError(_missing_package_message(directory / f"{stem}[.gz]"))


def load_fashion_mnist(split: str = "train", *, directory: str | Path = FASHION_MNIST_DIR, image: bool = False,
                       classes: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Features float32 in [0, 1] ([N, 784], or [N, 1, 28, 28] with image=True) and labels (long) of the
    split as shipped (train: 60,000, test: 10,000); `classes` keeps only those labels (unchanged)."""
    if split not in FASHION_MNIST_FILES:
        raise EdgetrainError(f"split must be 'train' or 'test', got {split!r}")
    directory = Path(directory)
    if not directory.is_dir():
        raise EdgetrainError(_missing_package_message(directory))
    images_name, labels_name = FASHION_MNIST_FILES[split]
    images_path, labels_path = _find_idx(directory, images_name), _find_idx(directory, labels_name)
    images, labels = read_idx(images_path), read_idx(labels_path)
    if images.dtype != np.uint8 or images.ndim != 3:
        raise EdgetrainError(f"{images_path}: expected uint8 images [N, rows, cols], got {images.dtype} {images.shape}")
    if labels.dtype != np.uint8 or labels.ndim != 1 or len(labels) != len(images):
        raise EdgetrainError(f"{labels_path}: expected {len(images)} uint8 labels, got {labels.dtype} {labels.shape}")
    if len(labels) and int(labels.max()) >= len(FASHION_MNIST_CLASSES):
        raise EdgetrainError(f"{labels_path}: label {int(labels.max())} outside 0..{len(FASHION_MNIST_CLASSES) - 1}")
    features = torch.from_numpy(images).to(torch.float32).div_(255.0)
    features = features.unsqueeze(1) if image else features.reshape(len(features), -1)
    features, targets = keep_classes(features, torch.from_numpy(labels).long(), classes,
                                     num_classes=len(FASHION_MNIST_CLASSES), dataset="Fashion-MNIST")
    return features, targets


def fashion_mnist_stream(split: str = "train", *, batch_size: int = 32, image: bool = False,
                         classes: Sequence[int] | None = None, directory: str | Path = FASHION_MNIST_DIR,
                         shuffle: bool = True, seed: int = 0, epochs: int | None = None,
                         start_index: int = 0) -> ArrayStream:
    """Batches of Fashion-MNIST: inputs [B, 784] (or [B, 1, 28, 28]) float32, targets [B] long;
    seeded per-epoch shuffle, `start_index=k` resumes at batch k."""
    features, labels = load_fashion_mnist(split, directory=directory, image=image, classes=classes)
    return ArrayStream(features, labels, batch_size=batch_size, shuffle=shuffle, seed=seed, epochs=epochs,
                       start_index=start_index)
