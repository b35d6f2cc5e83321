"""IDX parsing (hand-written files, damaged files, random bytes) and the Fashion-MNIST stream."""
from __future__ import annotations

import gzip
import itertools
import struct

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgetrain.data import FASHION_MNIST_DIR, fashion_mnist_stream, load_fashion_mnist, make_stream, parse_idx, read_idx
from edgetrain.registry import EdgetrainError

_CODES = {np.dtype(np.uint8): 0x08, np.dtype(np.int8): 0x09, np.dtype(">i2"): 0x0B, np.dtype(">i4"): 0x0C,
          np.dtype(">f4"): 0x0D, np.dtype(">f8"): 0x0E}


def idx_bytes(array: np.ndarray, dtype: str | type = np.uint8) -> bytes:
    """An IDX file written by hand: magic, dtype code, ndim, big-endian sizes, big-endian payload."""
    dtype = np.dtype(dtype)
    header = bytes([0, 0, _CODES[dtype], array.ndim]) + b"".join(struct.pack(">I", n) for n in array.shape)
    return header + array.astype(dtype).tobytes()


def test_plain_and_gzip_idx_files(tmp_path):
    images = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    (tmp_path / "images-idx3-ubyte").write_bytes(idx_bytes(images))
    (tmp_path / "images-idx3-ubyte.gz").write_bytes(gzip.compress(idx_bytes(images)))
    (tmp_path / "gzip-without-suffix").write_bytes(gzip.compress(idx_bytes(images)))  # detected by content
    for name in ("images-idx3-ubyte", "images-idx3-ubyte.gz", "gzip-without-suffix"):
        loaded = read_idx(tmp_path / name)
        assert loaded.dtype == np.uint8 and np.array_equal(loaded, images)
    assert torch.equal(torch.from_numpy(read_idx(tmp_path / "images-idx3-ubyte")), torch.from_numpy(images))


@pytest.mark.parametrize("dtype,values", [
    (np.int8, [-128, 0, 127]), (">i2", [-300, 2, 30000]), (">i4", [7, -1, 2**31 - 1]),
    (">f4", [0.5, -1.25, 3e38]), (">f8", [1e-300, -2.5, np.pi]),
])
def test_every_idx_element_type(dtype, values):
    array = np.array(values).astype(dtype)
    parsed = parse_idx(idx_bytes(array, dtype))
    assert parsed.dtype.isnative and np.array_equal(parsed, array)


@pytest.mark.parametrize("data,message", [
    (idx_bytes(np.zeros((2, 3), np.uint8))[:-1], r"payload has 5 bytes, its header \(2, 3\) x 1 needs 6"),
    (idx_bytes(np.zeros((2, 3), np.uint8)) + b"\0", "payload has 7 bytes"),
    (idx_bytes(np.zeros((2, 3), np.uint8))[:9], "IDX header truncated"),
    (b"\x01\x00\x08\x01" + bytes(8), "bad magic number"),
    (b"PK\x03\x04", "bad magic number"),
    (b"", "bad magic number"),
    (b"\x00\x00\x07\x01\x00\x00\x00\x01\x00", "unknown IDX element type 0x07"),
    (b"\x00\x00\x08\x00", "0 dimensions"),
    (b"\x00\x00\x0e\x04" + b"\xff" * 16, "truncated or damaged"),  # a huge declared shape cannot overflow
])
def test_damaged_idx_bytes_name_the_source(data, message):
    with pytest.raises(EdgetrainError, match=message) as error:
        parse_idx(data, "fake-idx1-ubyte")
    assert str(error.value).startswith("fake-idx1-ubyte: ")


def test_damaged_idx_files_name_the_file(tmp_path):
    good = idx_bytes(np.arange(100, dtype=np.uint8).reshape(10, 10))
    (tmp_path / "truncated-idx2-ubyte").write_bytes(good[:-10])
    (tmp_path / "truncated-idx2-ubyte.gz").write_bytes(gzip.compress(good[:-10]))
    (tmp_path / "cut-gzip.gz").write_bytes(gzip.compress(good)[:-20])
    (tmp_path / "bad-deflate.gz").write_bytes(gzip.compress(good)[:10] + b"\xff" * 30)
    for name in ("truncated-idx2-ubyte", "truncated-idx2-ubyte.gz", "cut-gzip.gz", "bad-deflate.gz"):
        with pytest.raises(EdgetrainError, match=name):
            read_idx(tmp_path / name)
    with pytest.raises(EdgetrainError, match="cannot read IDX file"):
        read_idx(tmp_path / "missing-idx1-ubyte")


_HEADER_PREFIXES = st.sampled_from([b"", b"\x00\x00", b"\x00\x00\x08\x01", b"\x00\x00\x08\x03", b"\x00\x00\x0d\x02"])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prefix=_HEADER_PREFIXES, body=st.binary(max_size=80), compress=st.sampled_from(["no", "gzip", "cut-gzip"]))
def test_random_bytes_as_idx_raise_only_edgetrain_error(tmp_path, prefix, body, compress):
    data = prefix + body
    if compress != "no":
        data = gzip.compress(data)
        if compress == "cut-gzip":
            data = data[:max(2, len(data) // 2)]
    path = tmp_path / "random-idx-ubyte"
    path.write_bytes(data)
    try:
        array = read_idx(path)
    except EdgetrainError:
        return
    assert isinstance(array, np.ndarray)  # a file that happens to be valid IDX is fine too


def _fake_fashion_dir(directory, counts=(("train", 12), ("t10k", 6)), compress=False, labels=None):
    """A miniature Fashion-MNIST with the shipped file names."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for prefix, count in counts:
        images = rng.integers(0, 256, size=(count, 28, 28), dtype=np.uint8)
        images[0, 0, 0], images[0, 0, 1] = 0, 255
        label_values = np.arange(count, dtype=np.uint8) % 10 if labels is None else labels
        for stem, array in ((f"{prefix}-images-idx3-ubyte", images), (f"{prefix}-labels-idx1-ubyte", label_values)):
            data = idx_bytes(array)
            if compress:
                (directory / (stem + ".gz")).write_bytes(gzip.compress(data))
            else:
                (directory / stem).write_bytes(data)
    return directory


@pytest.mark.parametrize("compress", [False, True])
def test_stream_over_a_miniature_fashion_mnist(tmp_path, compress):
    directory = _fake_fashion_dir(tmp_path / "fm", compress=compress)
    features, labels = load_fashion_mnist("train", directory=directory)
    assert features.shape == (12, 784) and features.dtype == torch.float32 and labels.dtype == torch.long
    assert float(features.min()) == 0.0 and float(features.max()) == 1.0
    images, _ = load_fashion_mnist("test", directory=directory, image=True)
    assert images.shape == (6, 1, 28, 28)
    _, sandals_and_bags = load_fashion_mnist("train", directory=directory, classes=[5, 8])
    assert sorted(set(sandals_and_bags.tolist())) == [5, 8]
    straight = list(itertools.islice(fashion_mnist_stream(directory=directory, batch_size=4, seed=1), 10))
    resumed = list(itertools.islice(fashion_mnist_stream(directory=directory, batch_size=4, seed=1, start_index=4), 6))
    assert all(torch.equal(a.inputs, b.inputs) and a.index == b.index for a, b in zip(straight[4:], resumed))


def test_inconsistent_files_are_refused(tmp_path):
    too_few_labels = _fake_fashion_dir(tmp_path / "a", counts=(("train", 5),), labels=np.zeros(4, np.uint8))
    with pytest.raises(EdgetrainError, match="train-labels-idx1-ubyte: expected 5 uint8 labels"):
        load_fashion_mnist("train", directory=too_few_labels)
    bad_label = _fake_fashion_dir(tmp_path / "b", counts=(("train", 3),), labels=np.array([1, 12, 3], np.uint8))
    with pytest.raises(EdgetrainError, match="label 12 outside 0..9"):
        load_fashion_mnist("train", directory=bad_label)
    with pytest.raises(EdgetrainError, match="t10k-images-idx3-ubyte.*apt-get install dataset-fashion-mnist"):
        load_fashion_mnist("test", directory=bad_label)  # only the train files were written
    with pytest.raises(EdgetrainError, match="split must be 'train' or 'test'"):
        load_fashion_mnist("valid", directory=bad_label)


def test_missing_directory_names_the_package_and_the_command(tmp_path):
    with pytest.raises(EdgetrainError, match="package dataset-fashion-mnist.*`apt-get install dataset-fashion-mnist`"):
        fashion_mnist_stream(directory=tmp_path / "nowhere")


@pytest.fixture(scope="module")
def real_fashion_mnist():
    return {split: load_fashion_mnist(split, image=True) for split in ("train", "test")}


@pytest.mark.skipif(not FASHION_MNIST_DIR.is_dir(),
                    reason="Fashion-MNIST not installed: apt-get install dataset-fashion-mnist")
def test_real_fashion_mnist_files(real_fashion_mnist):
    for split, count in (("train", 60_000), ("test", 10_000)):
        images, labels = real_fashion_mnist[split]
        assert images.shape == (count, 1, 28, 28) and images.dtype == torch.float32
        assert float(images.min()) == 0.0 and float(images.max()) == 1.0
        assert torch.bincount(labels).tolist() == [count // 10] * 10  # labels 0..9, balanced
    raw = read_idx(FASHION_MNIST_DIR / "t10k-labels-idx1-ubyte.gz")
    assert raw.shape == (10_000,) and raw.dtype == np.uint8


@pytest.mark.skipif(not FASHION_MNIST_DIR.is_dir(),
                    reason="Fashion-MNIST not installed: apt-get install dataset-fashion-mnist")
def test_real_fashion_mnist_stream():
    stream = make_stream("fashion-mnist", split="test", batch_size=100, shuffle=False)
    batch = next(iter(stream))
    assert batch.inputs.shape == (100, 784) and batch.targets.shape == (100,)
    assert stream.batches_per_epoch == 100
