"""Issue 53: the native MeSP runner (targets/executorch/mesp_runner.cpp) and the files an app ships with it,
attacked. Every weights file, program, batch file and checkpoint flipped, truncated, extended, emptied, swapped
for another one, made a directory or a FIFO, or forged with a valid checksum over a hostile header; hostile
flags and output paths; SIGKILL at random moments. Each case ends in a named refusal (exit status 2, 3 or 4
with one sentence naming the file on stderr, nothing written, every file of the run as it was) or in a result
checked bit for bit against an uninterrupted run or the Python replay. A signal, a hang, exit status 1 or a
wrong result fails the case. The Python readers of the same files (read_batch_file, WeightsFile,
MeSPProgramTrainer) are attacked with the same damaged files."""
from __future__ import annotations

import copy
import itertools
import os
import random
import shutil
import signal
import struct
import subprocess
import time
import zlib
from pathlib import Path

import pytest
import torch

import edgetrain
import fault_tally

pytest.importorskip("executorch.exir", reason="ExecuTorch not installed: pip install 'edgetrain[export]'")

from edgetrain.export import make_trainable, read_batch_file, write_batch_file  # noqa: E402
from edgetrain.export.mesp_program import (FORMAT_VERSION, AdamWSettings, MeSPProgramTrainer,  # noqa: E402
                                           export_mesp_program)
from edgetrain.export.native import MESP_RUNNER, build_runner  # noqa: E402
from edgetrain.export.weights_file import WeightsFile  # noqa: E402

CLASS = "native runner"
STEPS = 5
LR = 1e-3
TIMEOUT = 60  # a case that has not ended by then hangs (a FIFO read, a loop over a hostile count)


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    if shutil.which("cmake") is None or shutil.which("c++") is None:
        pytest.skip("building the native runner needs cmake and a C++ compiler")
    return build_runner(tmp_path_factory.mktemp("attack-build"), target=MESP_RUNNER)


def _export(directory: Path, seq: int):
    from edgetrain.data import make_stream

    torch.manual_seed(0)
    model = make_trainable(edgetrain.load_model("tiny", quantize_bits=4), "lora", rank=4)
    program, weights = export_mesp_program(model, 2, seq, directory / "tiny.pte", delegate="none")
    batches = list(itertools.islice(make_stream("text", batch_size=2, seq_len=seq, vocab_size=256), STEPS))
    return program, weights, write_batch_file(directory / "batches.bin", batches), batches


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """tiny, [2, 16] batches, on ExecuTorch's own kernels (the refusals do not depend on the kernels)."""
    return _export(tmp_path_factory.mktemp("attack-export"), 16)


@pytest.fixture(scope="module")
def other_shape(tmp_path_factory):
    """The same model exported for [2, 8] batches: another program, weights file, batch file and checkpoint
    (a second export: its cases are in the slow lane; the default one swaps the export's own files)."""
    return _export(tmp_path_factory.mktemp("attack-other"), 8)


def _run(runner, *args, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    try:
        return subprocess.run([str(runner), *map(str, args)], capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    except subprocess.TimeoutExpired:
        fault_tally.record(CLASS, "unhandled")
        raise AssertionError(f"the runner hangs on {args}") from None


def _losses(output: str) -> list[float]:
    return [float(line.split()[3]) for line in output.splitlines() if line.startswith("step ")]


def _errors(result: subprocess.CompletedProcess, name: str = "edgetrain_mesp_runner") -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith(f"{name}:")]


def _snapshot(directory: Path) -> dict[str, bytes | str]:
    """Every entry of `directory`: a file's bytes, or what else it is."""
    return {p.name: (p.read_bytes() if p.is_file() and not p.is_symlink() else
                     "fifo" if p.is_fifo() else "dir" if p.is_dir() else "link")
            for p in sorted(directory.iterdir())}


def _refused(result: subprocess.CompletedProcess, status: int, *words: str, before=None, directory=None,
             name: str = "edgetrain_mesp_runner", steps_first: bool = False) -> None:
    """The runner `name` refused with `status` and one sentence holding `words`, before any step (unless
    `steps_first`: the ET runner's kernels refuse a batch after the steps before it), and `directory` is as
    `before`."""
    if result.returncode != status:
        fault_tally.record(CLASS, "silently wrong" if result.returncode == 0 else "unhandled")
        raise AssertionError(f"exit status {result.returncode}, not {status}: {result.stderr[-800:]}")
    errors = _errors(result, name)
    if len(errors) != 1 or not all(word in errors[0] for word in words) or (_losses(result.stdout) and not steps_first):
        fault_tally.record(CLASS, "silently wrong")
        raise AssertionError(f"the refusal does not say {words} in one sentence, before any step: {errors}")
    if before is not None and _snapshot(directory) != before:
        fault_tally.record(CLASS, "silently wrong")
        raise AssertionError(f"a refused run changed {directory}: {sorted(_snapshot(directory))}")
    fault_tally.record(CLASS, "refused")


@pytest.fixture(scope="module")
def reference(runner, exported, tmp_path_factory):
    """An uninterrupted run of every batch, and the checkpoints after steps 2 and 3."""
    program, _, batch_file, _ = exported
    directory = tmp_path_factory.mktemp("attack-reference")
    whole = _run(runner, program, batch_file, "--lr", LR, "--checkpoint", directory / "whole.ckpt",
                 "--save", directory / "whole.safetensors")
    assert whole.returncode == 0, whole.stderr
    for steps in range(1, STEPS):
        partial = _run(runner, program, batch_file, "--lr", LR, "--steps", steps, "--checkpoint",
                       directory / f"step{steps}.ckpt")
        assert partial.returncode == 0, partial.stderr
    return {"losses": _losses(whole.stdout), "adapter": (directory / "whole.safetensors").read_bytes(),
            "final": (directory / "whole.ckpt").read_bytes(),
            **{f"step{steps}": (directory / f"step{steps}.ckpt").read_bytes() for steps in range(1, STEPS)}}


@pytest.fixture
def workspace(exported, tmp_path):
    """A copy of the exported files to damage, with an adapter and a checkpoint already there (a refused run
    must leave both as they were)."""
    program, weights, batch_file, _ = exported
    for source in (program, weights, batch_file):
        shutil.copy(source, tmp_path / Path(source).name)
    (tmp_path / "kept.safetensors").write_bytes(b"an adapter saved by an earlier run")
    return tmp_path


def _command(directory: Path, *extra, program="tiny.pte", batches="batches.bin"):
    return [directory / program, directory / batches, "--lr", LR, "--save", directory / "kept.safetensors",
            "--checkpoint", directory / "new.ckpt", *extra]


# -- files that are not files -----------------------------------------------------------------------------

def _not_a_file(path: Path, kind: str) -> None:
    path.unlink()
    if kind == "directory":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "dangling link":
        path.symlink_to(path.parent / "nowhere")


@pytest.mark.parametrize("kind", ["directory", "fifo", "empty", "missing", "dangling link"])
@pytest.mark.parametrize("role", ["program", "weights", "batches"])
def test_an_input_that_is_not_a_file_is_refused_naming_it(runner, workspace, role, kind):
    path = workspace / {"program": "tiny.pte", "weights": "tiny.weights", "batches": "batches.bin"}[role]
    if kind == "missing":
        path.unlink()
    else:
        _not_a_file(path, kind)
    before = _snapshot(workspace)
    extra = ["--weights", workspace / "tiny.weights"]
    result = _run(runner, *_command(workspace, *extra))
    _refused(result, 3, path.name, before=before, directory=workspace)
    if role != "program":  # the Python readers of the same files
        reader = (lambda: WeightsFile(path)) if role == "weights" else (lambda: read_batch_file(path))
        fault_tally.refused(CLASS, reader, path.name)


# -- damaged bytes: flipped, truncated, extended ------------------------------------------------------------

def _damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    kind, _, where = how.partition(" ")
    position = {"start": 0, "header": 13, "middle": len(data) // 2, "end": len(data) - 1}.get(where)
    if kind == "flip":
        data[position] ^= 0x10
    elif kind == "truncate":
        data = data[:{"to 8": 8, "to 23": 23, "half": len(data) // 2, "by 1": len(data) - 1}[where]]
    elif kind == "extend":
        data += b"\0" if where == "by 1" else os.urandom(4096)
    path.write_bytes(bytes(data))


DAMAGE = ["flip start", "flip header", "flip middle", "flip end", "truncate to 8", "truncate to 23",
          "truncate half", "truncate by 1", "extend by 1", "extend by 4096"]


@pytest.mark.parametrize("how", DAMAGE)
@pytest.mark.parametrize("role", ["program", "weights", "batches"])
def test_a_damaged_input_is_refused_naming_it(runner, workspace, exported, role, how):
    name = {"program": "tiny.pte", "weights": "tiny.weights", "batches": "batches.bin"}[role]
    _damage(workspace / name, how)
    before = _snapshot(workspace)
    result = _run(runner, *_command(workspace))
    _refused(result, 3, name, before=before, directory=workspace)
    program, weights, _, batches = exported
    if role == "weights":
        fault_tally.refused(CLASS, lambda: MeSPProgramTrainer(program, workspace / name), name)
    elif role == "program":
        fault_tally.refused(CLASS, lambda: MeSPProgramTrainer(workspace / name, weights), name)
    elif how in ("flip middle", "flip end"):  # a token id made huge: the file is whole, the ids are not
        trainer = MeSPProgramTrainer(program, weights, AdamWSettings(lr=LR))
        fault_tally.refused(CLASS, lambda: [trainer.check_batch(b) for b in read_batch_file(workspace / name)])
    else:
        fault_tally.refused(CLASS, lambda: read_batch_file(workspace / name), name)


# -- another model's or another shape's file -------------------------------------------------------------

OTHER_SHAPE = pytest.mark.slow  # a second export, about a minute


@pytest.mark.parametrize("swap", [pytest.param(case, marks=OTHER_SHAPE) for case in (
                                  "program of another shape", "weights of another shape", "batches of another shape",
                                  "program and weights of another shape")] + ["weights file as the program",
                                  "program as the weights file", "batch file as the weights file",
                                  "weights file as the batch file"])
def test_a_file_swapped_for_another_is_refused(runner, workspace, request, swap):
    other_program, other_weights, other_batches, _ = (request.getfixturevalue("other_shape") if "another shape" in swap
                                                      else (None,) * 4)
    sources = {"program of another shape": [(other_program, "tiny.pte")],
               "weights of another shape": [(other_weights, "tiny.weights")],
               "batches of another shape": [(other_batches, "batches.bin")],
               "program and weights of another shape": [(other_program, "tiny.pte"), (other_weights, "tiny.weights")],
               "weights file as the program": [(workspace / "tiny.weights", "tiny.pte")],
               "program as the weights file": [(workspace / "tiny.pte", "tiny.weights")],
               "batch file as the weights file": [(workspace / "batches.bin", "tiny.weights")],
               "weights file as the batch file": [(workspace / "tiny.weights", "batches.bin")]}[swap]
    staged = {name: Path(source).read_bytes() for source, name in sources}
    for name, data in staged.items():
        (workspace / name).write_bytes(data)
    before = _snapshot(workspace)
    _refused(_run(runner, *_command(workspace)), 3, before=before, directory=workspace)


# -- a weights file forged with a valid checksum over a hostile header -------------------------------------

def _entries(data: bytes) -> dict[str, dict[str, int]]:
    """Where each tensor's header fields lie in a weights file."""
    count, manifest = struct.unpack_from("<IQ", data, 12)
    offset, entries = 24 + manifest, {}
    for _ in range(count):
        (length,) = struct.unpack_from("<I", data, offset)
        name = data[offset + 4:offset + 4 + length].decode()
        entry = {"name_at": offset + 4, "code_at": offset + 4 + length, "ndim_at": offset + 8 + length}
        offset += 12 + length
        entry["ndim"] = struct.unpack_from("<I", data, entry["ndim_at"])[0]
        entry["dims_at"] = offset
        offset += 8 * entry["ndim"]
        entry["offset_at"], entry["nbytes_at"] = offset, offset + 8
        entry["offset"], entry["nbytes"] = struct.unpack_from("<QQ", data, offset)
        offset += 16
        entries[name] = entry
    return entries


def _seal(data: bytearray) -> bytes:
    struct.pack_into("<I", data, 8, zlib.crc32(bytes(data[12:])))
    return bytes(data)


def _forge(data: bytes, how: str) -> bytes:
    out, entries = bytearray(data), _entries(data)
    cos, meta, embed = entries["rope.cos"], entries["program.meta"], entries["inputs.embed"]
    codes = entries["blocks.0.q.codes"]
    put = {
        "manifest length 2^63": lambda: struct.pack_into("<Q", out, 16, 1 << 63),
        "manifest length past the end": lambda: struct.pack_into("<Q", out, 16, len(data)),
        "tensor count 2^32-1": lambda: struct.pack_into("<I", out, 12, 0xFFFFFFFF),
        "name length 2^32-1": lambda: struct.pack_into("<I", out, cos["name_at"] - 4, 0xFFFFFFFF),
        "dims 2^32 x 2^32 over 0 bytes": lambda: (struct.pack_into("<qq", out, cos["dims_at"], 1 << 32, 1 << 32),
                                                  struct.pack_into("<Q", out, cos["nbytes_at"], 0)),
        "dims whose product wraps to the size": lambda: struct.pack_into(
            "<qq", out, cos["dims_at"], (1 << 62) + 16, 32),
        "a negative dimension": lambda: struct.pack_into("<q", out, cos["dims_at"], -16),
        "data offset that wraps": lambda: struct.pack_into("<Q", out, cos["offset_at"], (1 << 64) - 8),
        "data past the end": lambda: struct.pack_into("<Q", out, cos["offset_at"], len(data) - 8),
        "nbytes 2^63": lambda: struct.pack_into("<Q", out, cos["nbytes_at"], 1 << 63),
        "misaligned data": lambda: struct.pack_into("<Q", out, cos["offset_at"], cos["offset"] + 1),
        "ndim 9": lambda: struct.pack_into("<I", out, cos["ndim_at"], 9),
        "dtype code 7": lambda: struct.pack_into("<I", out, cos["code_at"], 7),
        # The version before this one (another layout of the codes) and one from a newer edgetrain.
        "the previous format version": lambda: struct.pack_into("<q", out, meta["offset"], FORMAT_VERSION - 1),
        "a newer format version": lambda: struct.pack_into("<q", out, meta["offset"], FORMAT_VERSION + 1),
        "meta: negative blocks": lambda: struct.pack_into("<q", out, meta["offset"] + 8, -1),
        "meta: 2^40 blocks": lambda: struct.pack_into("<q", out, meta["offset"] + 8, 1 << 40),
        "meta: batch 4, not the program's 2": lambda: struct.pack_into("<q", out, meta["offset"] + 16, 4),
        "meta: hidden 2^30": lambda: struct.pack_into("<q", out, meta["offset"] + 40, 1 << 30),
        "meta: adapter numel 1": lambda: struct.pack_into("<q", out, meta["offset"] + 48, 1),
        "an input list past the tensors": lambda: struct.pack_into("<q", out, embed["offset"], 10 ** 6),
        "a negative input index": lambda: struct.pack_into("<q", out, embed["offset"], -1),
        "a frozen matrix transposed": lambda: struct.pack_into("<qq", out, codes["dims_at"], 128, 64),
        "a frozen matrix's dtype changed": lambda: struct.pack_into("<I", out, codes["code_at"], 2),
        "an input list naming another tensor": lambda: struct.pack_into(
            "<q", out, embed["offset"], list(entries).index("rope.cos")),
        "rope.cos renamed": lambda: out.__setitem__(slice(cos["name_at"], cos["name_at"] + 8), b"rope.cox"),
        "adapters.layout past the vector": lambda: struct.pack_into(
            "<q", out, entries["adapters.layout"]["offset"], 9344),
        "adapters.layout overlapping": lambda: struct.pack_into(
            "<q", out, entries["adapters.layout"]["offset"] + 24, 0),
        "adapters.metadata not an object": lambda: out.__setitem__(entries["adapters.metadata"]["offset"], ord("x")),
    }[how]
    put()
    return _seal(out)


# Where the Python replay reads the same field, it refuses too; the adapter layout and metadata it takes from the
# manifest (which the forgery leaves alone) and never reads the hidden size or adapter length from program.meta,
# so there it trains as on the clean file.
REPLAY_READS = {"meta: hidden 2^30": False, "meta: adapter numel 1": False,
                "adapters.layout past the vector": False, "adapters.layout overlapping": False,
                "adapters.metadata not an object": False}
FORGERIES = ["manifest length 2^63", "manifest length past the end", "tensor count 2^32-1", "name length 2^32-1",
             "dims 2^32 x 2^32 over 0 bytes", "dims whose product wraps to the size", "a negative dimension",
             "data offset that wraps", "data past the end", "nbytes 2^63", "misaligned data", "ndim 9",
             "dtype code 7", "the previous format version", "a newer format version", "meta: negative blocks",
             "meta: 2^40 blocks",
             "meta: batch 4, not the program's 2", "meta: hidden 2^30", "meta: adapter numel 1",
             "an input list past the tensors", "a negative input index", "a frozen matrix transposed",
             "a frozen matrix's dtype changed", "an input list naming another tensor", "rope.cos renamed",
             "adapters.layout past the vector", "adapters.layout overlapping", "adapters.metadata not an object"]


@pytest.fixture(scope="module")
def clean_replay_loss(exported):
    program, weights, _, batches = exported
    return MeSPProgramTrainer(program, weights, AdamWSettings(lr=LR)).step(batches[0])


@pytest.mark.parametrize("how", FORGERIES)
def test_a_forged_weights_file_is_refused_without_a_crash(runner, workspace, exported, clean_replay_loss, how):
    path = workspace / "tiny.weights"
    path.write_bytes(_forge(path.read_bytes(), how))
    before = _snapshot(workspace)
    _refused(_run(runner, *_command(workspace)), 3, "tiny.weights", before=before, directory=workspace)

    program, _, _, batches = exported

    def replay():
        trainer = MeSPProgramTrainer(program, path, AdamWSettings(lr=LR))
        return trainer.step(batches[0])

    if REPLAY_READS.get(how, True):
        fault_tally.refused(CLASS, replay)
    else:
        fault_tally.attempt(CLASS, replay, sound=lambda loss: loss == clean_replay_loss)


# -- batch files --------------------------------------------------------------------------------------------

def _batch_file(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    header = 8 + 4 + 2 * (8 + 16)  # two int64 [2, 16] tensors
    put = {
        "magic": lambda: data.__setitem__(slice(0, 8), b"EDGEBAT2"),
        "three tensors a batch": lambda: struct.pack_into("<I", data, 8, 3),
        "dtype code 2": lambda: struct.pack_into("<I", data, 12, 2),
        "float32 inputs": lambda: struct.pack_into("<I", data, 12, 0),
        "ndim 9": lambda: struct.pack_into("<I", data, 16, 9),
        "a negative dimension": lambda: struct.pack_into("<q", data, 20, -2),
        "a dimension of 2^40": lambda: struct.pack_into("<q", data, 20, 1 << 40),
        "dims whose product wraps": lambda: struct.pack_into("<qq", data, 20, 1 << 62, 4),
        "2^63 batches announced": lambda: struct.pack_into("<Q", data, header, 1 << 63),
        "6 batches announced, 5 held": lambda: struct.pack_into("<Q", data, header, STEPS + 1),
        "0 batches announced": lambda: struct.pack_into("<Q", data, header, 0),
        "a torn last batch": lambda: data.__delitem__(slice(len(data) - 100, None)),
        "half a batch more": lambda: data.extend(bytes(256)),
        "an input id of 256": lambda: struct.pack_into("<q", data, header + 8 + 3 * 8, 256),
        "an input id of -1": lambda: struct.pack_into("<q", data, header + 8 + 3 * 8, -1),
        "an input id of 2^62 in the last batch": lambda: struct.pack_into("<q", data, len(data) - 512, 1 << 62),
        "a target of 256": lambda: struct.pack_into("<q", data, header + 8 + 256 + 8, 256),
        "a target of -5": lambda: struct.pack_into("<q", data, header + 8 + 256 + 8, -5),
    }[how]
    put()
    path.write_bytes(bytes(data))


BATCH_DAMAGE = ["magic", "three tensors a batch", "dtype code 2", "float32 inputs", "ndim 9", "a negative dimension",
                "a dimension of 2^40", "dims whose product wraps", "2^63 batches announced",
                "6 batches announced, 5 held", "0 batches announced", "a torn last batch", "half a batch more",
                "an input id of 256", "an input id of -1", "an input id of 2^62 in the last batch",
                "a target of 256", "a target of -5"]
# The file itself is whole in these: the ids are the program's concern (MeSPProgramTrainer.check_batch).
IDS_ONLY = {"an input id of 256", "an input id of -1", "an input id of 2^62 in the last batch", "a target of 256",
            "a target of -5", "float32 inputs"}


@pytest.mark.parametrize("how", BATCH_DAMAGE)
def test_a_hostile_batch_file_is_refused_before_any_step(runner, workspace, exported, how):
    path = workspace / "batches.bin"
    _batch_file(path, how)
    before = _snapshot(workspace)
    _refused(_run(runner, *_command(workspace)), 3, "batches.bin", before=before, directory=workspace)
    if how not in IDS_ONLY:
        fault_tally.refused(CLASS, lambda: read_batch_file(path), "batches.bin")
    elif how != "float32 inputs":
        program, weights, _, _ = exported
        trainer = MeSPProgramTrainer(program, weights, AdamWSettings(lr=LR))
        fault_tally.refused(CLASS, lambda: [trainer.check_batch(batch) for batch in read_batch_file(path)])


@pytest.mark.parametrize("how", ["ignored targets (-100)", "a flipped token id"])
def test_a_usable_batch_file_trains_as_the_replay(runner, workspace, exported, how):
    """Batches that are valid, if not the ones written: the runner trains on exactly what the file holds."""
    program, weights, _, batches = exported
    path = workspace / "batches.bin"
    data = bytearray(path.read_bytes())
    header = 8 + 4 + 2 * (8 + 16)
    if how == "ignored targets (-100)":
        struct.pack_into("<4q", data, header + 256 + 8 * 4, -100, -100, -100, -100)
    else:
        data[header + 8 * 5] ^= 0x01
    path.write_bytes(bytes(data))
    with fault_tally.checked(CLASS):
        result = _run(runner, program, path, "--lr", LR)
        assert result.returncode == 0, result.stderr
        replay = MeSPProgramTrainer(program, weights, AdamWSettings(lr=LR))
        expected = [replay.step(batch) for batch in read_batch_file(path)]
        assert _losses(result.stdout) == [float(f"{loss:.9g}") for loss in expected]


# -- checkpoints ----------------------------------------------------------------------------------------------

def _reseal(data: bytearray) -> bytes:
    struct.pack_into("<I", data, 8, zlib.crc32(bytes(data[12:])))
    return bytes(data)


def _checkpoint(data: bytes, how: str) -> bytes:
    out = bytearray(data)
    header = 12 + 4 + 4 + 24 + 40
    edits = {
        "flip magic": lambda: out.__setitem__(0, out[0] ^ 1),
        "flip checksum": lambda: out.__setitem__(9, out[9] ^ 1),
        "flip program crc": lambda: out.__setitem__(13, out[13] ^ 1),
        "flip step count": lambda: out.__setitem__(20, out[20] ^ 1),
        "flip a setting": lambda: out.__setitem__(50, out[50] ^ 1),
        "flip an adapter": lambda: out.__setitem__(header + 5, out[header + 5] ^ 1),
        "flip the last byte": lambda: out.__setitem__(len(out) - 1, out[-1] ^ 1),
        "truncate by 1": lambda: out.__delitem__(slice(len(out) - 1, None)),
        "truncate to 12": lambda: out.__delitem__(slice(12, None)),
        "truncate to 0": lambda: out.clear(),
        "extend by 1": lambda: out.append(0),
        "older format (EDGECKP1)": lambda: out.__setitem__(slice(0, 8), b"EDGECKP1"),
        "forged: step 99 of 5 batches": lambda: (struct.pack_into("<Q", out, 20, 99), _reseal(out)),
        "forged: step 2^64-1": lambda: (struct.pack_into("<Q", out, 20, (1 << 64) - 1), _reseal(out)),
        "forged: step 3 on step 2's state": lambda: (struct.pack_into("<Q", out, 20, 3), _reseal(out)),
        "forged: another program's crc": lambda: (struct.pack_into("<I", out, 12, 12345), _reseal(out)),
        "forged: 3 blocks": lambda: (struct.pack_into("<Q", out, 28, 3), _reseal(out)),
        "forged: a NaN adapter": lambda: (struct.pack_into("<f", out, header, float("nan")), _reseal(out)),
        "forged: an infinite moment": lambda: (struct.pack_into("<f", out, header + 9344 * 4, float("inf")),
                                               _reseal(out)),
        "forged: a negative second moment": lambda: (struct.pack_into("<f", out, header + 2 * 9344 * 4 + 4, -1.0),
                                                     _reseal(out)),
        "forged: another lr": lambda: (struct.pack_into("<d", out, 44, 0.5), _reseal(out)),
    }
    result = edits[how]()
    return result[1] if isinstance(result, tuple) else bytes(out)


CHECKPOINT_DAMAGE = ["flip magic", "flip checksum", "flip program crc", "flip step count", "flip a setting",
                     "flip an adapter", "flip the last byte", "truncate by 1", "truncate to 12", "truncate to 0",
                     "extend by 1", "older format (EDGECKP1)", "forged: step 99 of 5 batches", "forged: step 2^64-1",
                     "forged: step 3 on step 2's state", "forged: another program's crc", "forged: 3 blocks",
                     "forged: a NaN adapter", "forged: an infinite moment", "forged: a negative second moment",
                     "forged: another lr"]


@pytest.mark.parametrize("how", CHECKPOINT_DAMAGE)
def test_a_damaged_checkpoint_is_refused_and_kept(runner, workspace, reference, how):
    (workspace / "new.ckpt").write_bytes(_checkpoint(reference["step2"], how))
    before = _snapshot(workspace)
    _refused(_run(runner, *_command(workspace)), 3, "new.ckpt", before=before, directory=workspace)


@pytest.mark.parametrize("how", [pytest.param("a checkpoint of another shape's program", marks=OTHER_SHAPE),
                                 "the batches changed under it",
                                 "resumed with another --lr", "resumed with another --beta2",
                                 "a checkpoint past --steps", "the batch file cut below its step"])
def test_a_checkpoint_of_another_run_is_refused_and_kept(runner, workspace, reference, request, exported, how):
    checkpoint, extra = workspace / "new.ckpt", []
    checkpoint.write_bytes(reference["step3"])
    if how == "a checkpoint of another shape's program":
        other_program, _, other_batches, _ = request.getfixturevalue("other_shape")
        checkpoint.unlink()
        made = _run(runner, other_program, other_batches, "--steps", 2, "--lr", LR, "--checkpoint", checkpoint)
        assert made.returncode == 0, made.stderr
    elif how == "the batches changed under it":  # one target of the first batch, another valid id
        data = bytearray((workspace / "batches.bin").read_bytes())
        target = 8 + 4 + 48 + 8 + 256 + 8
        struct.pack_into("<q", data, target, (struct.unpack_from("<q", data, target)[0] + 1) % 256)
        (workspace / "batches.bin").write_bytes(bytes(data))
    elif how == "resumed with another --lr":
        extra = ["--lr", LR * 10]
    elif how == "resumed with another --beta2":
        extra = ["--beta2", 0.99]
    elif how == "a checkpoint past --steps":
        extra = ["--steps", 2]
    else:
        program, weights, _, batches = exported
        write_batch_file(workspace / "batches.bin", batches[:2])
    command = _command(workspace, *extra)
    if "--lr" in extra:
        command = command[:2] + command[4:]
    before = _snapshot(workspace)
    _refused(_run(runner, *command), 3, "new.ckpt", before=before, directory=workspace)


@pytest.mark.parametrize("step", [2, 3, 5])
def test_a_checkpoint_of_another_step_resumes_to_the_same_adapter(runner, workspace, reference, step):
    """A checkpoint of step 2, 3 or 5 (the last) in place of another: the run resumes from it and ends with the
    uninterrupted run's adapter, byte for byte."""
    checkpoint = workspace / "new.ckpt"
    checkpoint.write_bytes({2: reference["step2"], 3: reference["step3"], 5: reference["final"]}[step])
    with fault_tally.checked(CLASS):
        result = _run(runner, *_command(workspace))
        assert result.returncode == 0, result.stderr
        assert _losses(result.stdout) == reference["losses"][step:]
        assert (workspace / "kept.safetensors").read_bytes() == reference["adapter"]
        assert checkpoint.read_bytes() == reference["final"]
        assert not (workspace / "new.ckpt.tmp").exists() and not (workspace / "kept.safetensors.tmp").exists()


@pytest.mark.parametrize("kind", ["directory", "fifo"])
@pytest.mark.parametrize("role", ["checkpoint", "save"])
def test_an_output_that_is_not_a_file_is_refused(runner, workspace, role, kind):
    path = workspace / ("new.ckpt" if role == "checkpoint" else "kept.safetensors")
    path.unlink(missing_ok=True)
    path.mkdir() if kind == "directory" else os.mkfifo(path)
    before = _snapshot(workspace)
    _refused(_run(runner, *_command(workspace)), 4, path.name, before=before, directory=workspace)


def test_a_read_only_checkpoint_directory_is_refused_and_the_checkpoint_kept(runner, workspace, reference):
    disk = workspace / "ro"
    disk.mkdir()
    (disk / "state.ckpt").write_bytes(reference["step2"])
    if os.geteuid() == 0:  # root writes through permission bits: a read-only mount then
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], capture_output=True)
        if mounted.returncode != 0:
            pytest.skip("root, and no mount to make a read-only directory with")
        (disk / "state.ckpt").write_bytes(reference["step2"])
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
    else:
        disk.chmod(0o555)
    try:
        before = _snapshot(disk)
        result = _run(runner, workspace / "tiny.pte", workspace / "batches.bin", "--lr", LR,
                      "--checkpoint", disk / "state.ckpt")
        _refused(result, 4, "state.ckpt", before=before, directory=disk)
    finally:
        if os.geteuid() == 0:
            subprocess.run(["umount", "-l", str(disk)], capture_output=True)
        else:
            disk.chmod(0o755)


# -- flags and output paths ---------------------------------------------------------------------------------

FLAGS = {
    "--lr nan": ["--lr", "nan"], "--lr inf": ["--lr", "inf"], "--lr 1e309": ["--lr", "1e309"],
    "--lr -1": ["--lr", "-1"], "--lr ''": ["--lr", ""], "--lr ' 1'": ["--lr", " 1"], "--lr 1e-3x": ["--lr", "1e-3x"],
    "--lr given twice": ["--lr", "1e-3", "--lr", "1e-2"], "--lr without a value": ["--lr"],
    "--beta1 1": ["--beta1", "1"], "--beta1 -0.1": ["--beta1", "-0.1"], "--beta2 1": ["--beta2", "1"],
    "--eps 0": ["--eps", "0"], "--eps -1e-8": ["--eps", "-1e-8"], "--eps 2": ["--eps", "2"],
    "--weight-decay -1": ["--weight-decay", "-1"], "--weight-decay nan": ["--weight-decay", "nan"],
    "--steps 0": ["--steps", "0"], "--steps -1": ["--steps", "-1"], "--steps 1.5": ["--steps", "1.5"],
    "--steps 1e3": ["--steps", "1e3"], "--steps 99999999999999999999": ["--steps", "99999999999999999999"],
    "--steps 18446744073709551616": ["--steps", "18446744073709551616"], "--steps ''": ["--steps", ""],
    "--steps twice": ["--steps", "1", "--steps", "2"], "--unknown": ["--unknown", "1"], "-x": ["-x"],
    "--save without a value": ["--save"], "--save --steps 1 (value forgotten)": ["--save", "--steps", "1"],
    "--weights ''": ["--weights", ""], "a third positional": ["extra.bin"],
}


@pytest.mark.parametrize("case", list(FLAGS))
def test_a_hostile_flag_is_refused_naming_it(runner, exported, tmp_path, monkeypatch, case):
    program, _, batch_file, _ = exported
    monkeypatch.chdir(tmp_path)  # a flag misread as a path must not leave a file here
    result = _run(runner, program, batch_file, "--checkpoint", tmp_path / "c.ckpt", *FLAGS[case])
    _refused(result, 2, before={}, directory=tmp_path)


def test_more_steps_than_batches_is_refused(runner, workspace):
    before = _snapshot(workspace)
    _refused(_run(runner, *_command(workspace, "--steps", STEPS + 1)), 3, "batches.bin", "--steps",
             before=before, directory=workspace)


@pytest.mark.parametrize("case", ["--save the program", "--save the weights file", "--save the batch file",
                                  "--save the checkpoint", "--checkpoint the weights file",
                                  "--checkpoint the batch file", "--save over the checkpoint's temporary",
                                  "--save whose temporary is the weights file", "--save a link to the weights file",
                                  "--save the program by another path"])
def test_an_output_over_another_file_of_the_run_is_refused(runner, workspace, case):
    w = workspace
    if case == "--save whose temporary is the weights file":
        (w / "tiny.weights").rename(w / "w.tmp")
    if case == "--save a link to the weights file":
        (w / "link.safetensors").symlink_to(w / "tiny.weights")
    save, checkpoint, weights = {
        "--save the program": (w / "tiny.pte", w / "c.ckpt", None),
        "--save the weights file": (w / "tiny.weights", w / "c.ckpt", None),
        "--save the batch file": (w / "batches.bin", w / "c.ckpt", None),
        "--save the checkpoint": (w / "c.ckpt", w / "c.ckpt", None),
        "--checkpoint the weights file": (w / "a.safetensors", w / "tiny.weights", None),
        "--checkpoint the batch file": (w / "a.safetensors", w / "batches.bin", None),
        "--save over the checkpoint's temporary": (w / "c.ckpt.tmp", w / "c.ckpt", None),
        "--save whose temporary is the weights file": (w / "w", w / "c.ckpt", w / "w.tmp"),
        "--save a link to the weights file": (w / "link.safetensors", w / "c.ckpt", None),
        "--save the program by another path": (w / "." / ".." / w.name / "tiny.pte", w / "c.ckpt", None),
    }[case]
    command = [w / "tiny.pte", w / "batches.bin", "--lr", LR, "--save", save, "--checkpoint", checkpoint]
    if weights is not None:
        command += ["--weights", weights]
    before = _snapshot(w)
    _refused(_run(runner, *command), 2, before=before, directory=w)


@pytest.mark.parametrize("flags", [("--lr", "0"), ("--eps", "1"), ("--beta1", "0", "--beta2", "0"),
                                   ("--weight-decay", "0", "--steps", "3")])
def test_edge_flags_that_are_valid_train_as_the_replay(runner, exported, flags):
    program, weights, batch_file, batches = exported
    options = dict(zip(flags[::2], flags[1::2]))
    settings = AdamWSettings(lr=float(options.get("--lr", LR)), eps=float(options.get("--eps", 1e-8)),
                             betas=(float(options.get("--beta1", 0.9)), float(options.get("--beta2", 0.999))),
                             weight_decay=float(options.get("--weight-decay", 1e-2)))
    with fault_tally.checked(CLASS):
        result = _run(runner, program, batch_file, *(flags if "--lr" in options else ("--lr", LR, *flags)))
        assert result.returncode == 0, result.stderr
        replay = MeSPProgramTrainer(program, weights, settings)
        steps = int(options.get("--steps", STEPS))
        assert _losses(result.stdout) == [float(f"{replay.step(b):.9g}") for b in batches[:steps]]


# -- SIGKILL at random moments ------------------------------------------------------------------------------

def _kill_and_resume(runner, exported, reference, directory: Path, delays: list[float]) -> None:
    """Runs killed after each of `delays` seconds (including during the checkpoint and the save), then one
    to the end: the saved adapter is at every moment the earlier one or the whole new one, the checkpoint a
    whole one, and the end is the uninterrupted run's adapter, byte for byte."""
    program, _, batch_file, _ = exported
    adapter, checkpoint = directory / "adapter.safetensors", directory / "state.ckpt"
    earlier = b"the adapter an earlier run saved"
    adapter.write_bytes(earlier)
    command = [str(runner), str(program), str(batch_file), "--lr", repr(LR), "--checkpoint", str(checkpoint),
               "--save", str(adapter)]
    for delay in delays:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                   env={**os.environ, "OMP_NUM_THREADS": "1"})
        time.sleep(delay)
        process.send_signal(signal.SIGKILL)
        process.wait()
        assert adapter.read_bytes() in (earlier, reference["adapter"])
        if checkpoint.exists():  # a whole checkpoint of some step, never a part of one
            assert checkpoint.read_bytes() in [reference["final"]] + [reference[f"step{s}"] for s in range(1, STEPS)]
        if process.returncode == 0:  # it finished before the kill: start over for the next one
            checkpoint.unlink()
            adapter.write_bytes(earlier)
    finished = _run(runner, *command[1:])
    assert finished.returncode == 0, finished.stderr
    assert adapter.read_bytes() == reference["adapter"]
    assert checkpoint.read_bytes() == reference["final"]
    losses = _losses(finished.stdout)
    assert losses == reference["losses"][len(reference["losses"]) - len(losses):]


@pytest.fixture(scope="module")
def run_seconds(runner, exported, tmp_path_factory):
    program, _, batch_file, _ = exported
    directory = tmp_path_factory.mktemp("attack-timing")
    started = time.monotonic()
    _run(runner, program, batch_file, "--lr", LR, "--checkpoint", directory / "c", "--save", directory / "a")
    return time.monotonic() - started


@pytest.mark.parametrize("seed", range(6))
def test_a_run_killed_at_a_random_moment_resumes_bit_for_bit(runner, exported, reference, run_seconds, tmp_path,
                                                             seed):
    rng = random.Random(seed)
    delays = [rng.uniform(0, run_seconds * 1.2) for _ in range(1 + seed % 3)]
    with fault_tally.checked(CLASS):
        _kill_and_resume(runner, exported, reference, tmp_path, delays)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(6, 66))
def test_many_random_kills_resume_bit_for_bit(runner, exported, reference, run_seconds, tmp_path, seed):
    rng = random.Random(seed)
    delays = [rng.uniform(0, run_seconds * 1.2) for _ in range(1 + seed % 5)]
    with fault_tally.checked(CLASS):
        _kill_and_resume(runner, exported, reference, tmp_path, delays)
