"""The manifest of an `export --method mesp --runtime mlx` directory (edgetrain/export/mlx_program.py): what
it records, and the checks that stand between the directory and MLX's readers.

MLX's readers of .mlxfn and .safetensors files crash the process (a segfault, std::bad_alloc) or load wrong
numbers from a damaged file. So manifest.json records every file's size and SHA-256 and its own SHA-256 (in
a canonical spelling an app can recompute), the weights file's metadata repeats the manifest's array layout,
and a reader checks all of it (`read_manifest`, `check_manifest`, `verified_bytes`, `check_tensors`) before
MLX sees a byte; `import_verified` hands MLX a private copy of exactly the bytes it checked.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any, Callable

from edgetrain.export.trainable import ExportError
from edgetrain.files.user import open_regular_file, parse_json

FORMAT = "edgetrain-mesp-mlx"
# 2: the manifest records each file's size and SHA-256 and its own SHA-256 ("files", "manifest_sha256").
FORMAT_VERSION = 2
FUNCTIONS = ("embed", "block_forward", "block_backward", "head", "adamw")
WEIGHTS = "weights.safetensors"
MANIFEST = "manifest.json"
# The files of a program directory, by fixed names: nothing in the manifest names a path.
FILES = tuple(f"{name}.mlxfn" for name in FUNCTIONS) + (WEIGHTS,)


# Bounds of the manifest's numbers: far above any real program, low enough that nothing sized by them overflows.
MAX_DIMENSION = 2**31 - 1
_MAX_BLOCKS = 100_000
# Arrays of all blocks together (a real model has a few thousand): the checks build lists this long.
_MAX_BLOCK_ARRAYS = 10_000_000
_MAX_FILE_BYTES = 2**50
# A manifest is a few KiB (a few hundred KiB for a model of hundreds of blocks); anything bigger is not one.
MAX_MANIFEST_BYTES = 16 << 20
_SHA256 = re.compile(r"[0-9a-f]{64}")
# An array name: dotted identifiers, as tree_flatten writes them (never a path, never empty).
_ARRAY_NAME = re.compile(r"[A-Za-z0-9_]+(?:\.[A-Za-z0-9_]+)*")


# The manifest's fields that say which array goes where, also written into the weights file's metadata (under
# LAYOUT_KEY): the weights' SHA-256 is in the manifest, so a manifest rewritten to reorder same-shaped arrays
# (with its own SHA-256 recomputed) no longer matches the weights it must describe.
LAYOUT_FIELDS = ("batch", "seq", "vocab", "hidden", "blocks", "block_arrays", "lora_arrays", "embed_arrays",
                 "head_lm_weight", "trainable")
LAYOUT_KEY = "edgetrain_mlx_layout"


def layout(manifest: dict[str, Any]) -> str:
    return json.dumps({field: manifest[field] for field in LAYOUT_FIELDS}, sort_keys=True, separators=(",", ":"))


def file_record(path: Path) -> dict[str, Any]:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return {"bytes": path.stat().st_size, "sha256": digest.hexdigest()}


def manifest_digest(manifest: dict[str, Any]) -> str:
    """The SHA-256 of the manifest without its "manifest_sha256" field, in a canonical JSON spelling (sorted
    keys, no spaces, ASCII), so that an app can recompute it from the parsed object."""
    body = {key: value for key, value in manifest.items() if key != "manifest_sha256"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


# What a missing file of a program directory means.
_MISSING = "is missing: not a complete exported MLX program; re-export it"


def read_manifest(directory: Path) -> dict[str, Any]:
    """manifest.json of a program directory as a JSON object: a regular file of at most MAX_MANIFEST_BYTES,
    UTF-8, strict JSON with no key twice (else ExportError naming it)."""
    path = directory / MANIFEST
    fd = open_regular_file(path, ExportError, "the manifest", missing=_MISSING)
    try:
        with os.fdopen(fd, "rb") as handle:
            data = handle.read(MAX_MANIFEST_BYTES + 1)
    except OSError as exc:
        raise ExportError(f"{path}: cannot read the manifest ({exc.strerror or exc})") from None
    if len(data) > MAX_MANIFEST_BYTES:
        raise ExportError(f"{path}: larger than {MAX_MANIFEST_BYTES >> 20} MiB: not an exported MLX program's manifest")
    where = str(path)
    try:
        text = data.decode("utf-8")  # json.loads would also take UTF-16 and UTF-32 bytes, which no export writes
    except UnicodeDecodeError as exc:
        raise ExportError(f"{where}: not UTF-8 ({exc})") from None
    manifest = parse_json(text, ExportError, where, unique_keys=True)
    if not isinstance(manifest, dict):
        raise ExportError(f"{path}: holds a JSON {type(manifest).__name__}, not an object: not an exported MLX "
                          "program's manifest")
    return manifest


_MANIFEST_FIELDS = ("format", "version", "batch", "seq", "vocab", "hidden", "blocks", "block_arrays", "lora_arrays",
                    "embed_arrays", "head_lm_weight", "trainable", "functions", "chunks", "files", "manifest_sha256")


def check_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    """Raise ExportError naming the field of manifest.json that is not what export_mlx_mesp writes. The checks
    of the format, version and SHA-256 come first: a manifest that passes them is the exporter's, and the
    checks after them stop one that was rewritten with a matching SHA-256 from reaching MLX."""
    path = directory / MANIFEST

    def bad(field: str, problem: str) -> ExportError:
        return ExportError(f"{path}: field {field!r} {problem}")

    if manifest.get("format") != FORMAT:
        raise bad("format", f"is {manifest.get('format')!r}, not {FORMAT!r}: not an edgetrain MLX MeSP program")
    version = manifest.get("version")
    if isinstance(version, bool) or not isinstance(version, int):
        raise bad("version", f"must be an integer, got {version!r}")
    if version < FORMAT_VERSION:
        raise bad("version", f"is {version}: an older edgetrain wrote this program without the checksums this "
                             f"one checks (version {FORMAT_VERSION}); re-export it with `edgetrain export --method "
                             "mesp --runtime mlx`")
    if version > FORMAT_VERSION:
        raise bad("version", f"is {version}: written by a newer edgetrain than this one (version "
                             f"{FORMAT_VERSION}); upgrade edgetrain or re-export it with this one")
    missing = [field for field in _MANIFEST_FIELDS if field not in manifest]
    if missing:
        raise bad(missing[0], "is missing: a damaged manifest; re-export the program")
    unknown = sorted(set(manifest) - set(_MANIFEST_FIELDS))
    if unknown:
        raise bad(unknown[0], f"is not a field of format version {FORMAT_VERSION}")
    recorded = manifest["manifest_sha256"]
    if not (isinstance(recorded, str) and _SHA256.fullmatch(recorded)):
        raise bad("manifest_sha256", f"must be 64 lowercase hex digits, got {recorded!r}")
    try:
        actual = manifest_digest(manifest)
    except (RecursionError, ValueError) as exc:
        raise bad("manifest_sha256", f"cannot be checked ({exc})") from None
    if actual != recorded:
        raise bad("manifest_sha256", "does not match the manifest's contents: the manifest was changed or damaged "
                                     "after export; re-export the program")
    for field, high in (("batch", MAX_DIMENSION), ("seq", MAX_DIMENSION), ("vocab", MAX_DIMENSION),
                        ("hidden", MAX_DIMENSION), ("blocks", _MAX_BLOCKS)):
        value = manifest[field]
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
            raise bad(field, f"must be an integer in [1, {high}], got {value!r}")
    names = {}
    for field in ("block_arrays", "lora_arrays", "embed_arrays"):
        value = manifest[field]
        if not (isinstance(value, list) and value and all(isinstance(n, str) and _ARRAY_NAME.fullmatch(n)
                                                          for n in value)):
            raise bad(field, "must be a non-empty list of array names (dotted identifiers)")
        if len(set(value)) != len(value):
            duplicate = next(n for n in value if value.count(n) > 1)
            raise bad(field, f"names {duplicate!r} twice")
        names[field] = value
    stray = [name for name in names["lora_arrays"] if name not in names["block_arrays"]]
    if stray:
        raise bad("lora_arrays", f"names {stray[0]!r}, which is not among block_arrays")
    heads = {"head.lm_weight"} | {f"embed.{name}" for name in names["embed_arrays"]}
    if not isinstance(manifest["head_lm_weight"], str) or manifest["head_lm_weight"] not in heads:
        raise bad("head_lm_weight", f"must be head.lm_weight or one of the embed arrays, got "
                                    f"{manifest['head_lm_weight']!r}")
    for field in ("block_arrays", "lora_arrays"):
        if manifest["blocks"] * len(names[field]) > _MAX_BLOCK_ARRAYS:
            raise bad(field, f"names {len(names[field])} arrays for each of {manifest['blocks']} blocks: more than "
                             f"{_MAX_BLOCK_ARRAYS} in all, which no model has")
    trainable = manifest["trainable"]
    if not isinstance(trainable, list) or len(trainable) != manifest["blocks"] * len(names["lora_arrays"]):
        raise bad("trainable", "must list the LoRA arrays of every block (blocks.<i>.<lora_arrays>)")
    expected = sorted(f"blocks.{i}.{name}" for i in range(manifest["blocks"]) for name in names["lora_arrays"])
    if trainable != expected:
        raise bad("trainable", "must list the LoRA arrays of every block (blocks.<i>.<lora_arrays>), sorted")
    for field in ("functions", "chunks"):
        if not isinstance(manifest[field], dict):
            raise bad(field, "must be a JSON object")
    files = manifest["files"]
    if not isinstance(files, dict) or sorted(files) != sorted(FILES):
        raise bad("files", f"must record exactly {', '.join(FILES)} (fixed names; it names "
                           f"{sorted(files) if isinstance(files, dict) else files!r})")
    for name, record in files.items():
        if not (isinstance(record, dict) and sorted(record) == ["bytes", "sha256"]
                and isinstance(record["bytes"], int) and not isinstance(record["bytes"], bool)
                and 1 <= record["bytes"] <= _MAX_FILE_BYTES
                and isinstance(record["sha256"], str) and _SHA256.fullmatch(record["sha256"])):
            raise bad("files", f"entry {name!r} must be {{\"bytes\": a positive integer, \"sha256\": 64 lowercase "
                               f"hex digits}}, got {record!r}")


def verified_bytes(path: Path, record: dict[str, Any], keep: bool) -> bytes | None:
    """Check that `path` is a regular file of the size and SHA-256 the manifest records (ExportError naming
    it otherwise); its bytes when `keep`."""
    what = f"the program's {path.name}"
    fd = open_regular_file(path, ExportError, what, missing=_MISSING)
    with os.fdopen(fd, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        if size != record["bytes"]:
            raise ExportError(f"{path}: {size} bytes, but manifest.json records {record['bytes']}: a truncated, "
                              "extended or foreign file; re-export the program")
        digest, chunks, total = hashlib.sha256(), [], 0
        try:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                total += len(chunk)
                if total > record["bytes"]:  # it grew while being read
                    break
                digest.update(chunk)
                if keep:
                    chunks.append(chunk)
        except OSError as exc:
            raise ExportError(f"{path}: cannot read {what} ({exc.strerror or exc})") from None
    if total != record["bytes"] or digest.hexdigest() != record["sha256"]:
        raise ExportError(f"{path}: its SHA-256 does not match manifest.json's: the file was damaged or swapped "
                          "after export; re-export the program")
    return b"".join(chunks) if keep else None


def import_verified(path: Path, data: bytes) -> Callable:
    """mx.import_function of exactly the verified bytes: they are written to a private temp file first, so
    that a file changed after its check never reaches MLX's reader (which a damaged file can crash)."""
    import mlx.core as mx

    with tempfile.TemporaryDirectory(prefix="edgetrain-mlxfn-") as private:
        copy_path = Path(private) / path.name
        copy_path.write_bytes(data)
        try:
            return mx.import_function(str(copy_path))
        except Exception as exc:  # MLX's reader raises ValueError, RuntimeError, IndexError, MemoryError
            raise ExportError(f"{path}: MLX cannot import this function ({type(exc).__name__}: {exc}); re-export "
                              "the program") from exc


def check_tensors(directory: Path, manifest: dict[str, Any], tensors: dict[str, Any]) -> None:
    """The weights must hold exactly the arrays the manifest names, with the shapes it implies."""
    import mlx.core as mx

    path = directory / WEIGHTS
    blocks = manifest["blocks"]
    expected = {"rope.cos", "rope.sin", "head.norm", *(f"embed.{name}" for name in manifest["embed_arrays"]),
                *(f"blocks.{i}.{name}" for i in range(blocks) for name in manifest["block_arrays"])}
    if manifest["head_lm_weight"] == "head.lm_weight":
        expected.add("head.lm_weight")
    missing = sorted(expected - set(tensors))
    if missing:
        raise ExportError(f"{path} lacks {missing[0]}: not this program's weights")
    extra = sorted(set(tensors) - expected)
    if extra:
        raise ExportError(f"{path} holds {extra[0]}, which manifest.json does not name: not this program's weights")
    for name in manifest["block_arrays"]:
        first = tensors[f"blocks.0.{name}"]
        for i in range(1, blocks):
            array = tensors[f"blocks.{i}.{name}"]
            if array.shape != first.shape or array.dtype != first.dtype:
                raise ExportError(f"{path}: blocks.{i}.{name} is {tuple(array.shape)} {array.dtype}, block 0's is "
                                  f"{tuple(first.shape)} {first.dtype}: one block function cannot serve both")
    seq, hidden, vocab = manifest["seq"], manifest["hidden"], manifest["vocab"]
    cos, sin = tensors["rope.cos"], tensors["rope.sin"]
    if cos.ndim != 2 or cos.shape[0] != seq or sin.shape != cos.shape:
        raise ExportError(f"{path}: rope.cos {tuple(cos.shape)} and rope.sin {tuple(sin.shape)} are not the RoPE "
                          f"tables of {seq} positions manifest.json's seq says")
    if tuple(tensors["head.norm"].shape) != (hidden,):
        raise ExportError(f"{path}: head.norm is {tuple(tensors['head.norm'].shape)}, not ({hidden},) as "
                          "manifest.json's hidden says")
    lm_weight = tensors[manifest["head_lm_weight"]]
    if lm_weight.ndim != 2 or lm_weight.shape[0] != vocab:
        raise ExportError(f"{path}: {manifest['head_lm_weight']} is {tuple(lm_weight.shape)}, not [{vocab}, ...] as "
                          "manifest.json's vocab says")
    for name in manifest["trainable"]:
        array = tensors[name]
        if not mx.issubdtype(array.dtype, mx.floating):
            raise ExportError(f"{path}: the adapter {name} is {array.dtype}, not floating point")
        if not bool(mx.all(mx.isfinite(array))):
            raise ExportError(f"{path}: the adapter {name} holds NaN or infinity")
