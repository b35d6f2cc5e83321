"""Issue 53: the second native runner, edgetrain_et_runner (targets/executorch/runner.cpp: SGD on a joint
forward-backward .pte), attacked as test_runner_attack.py attacks the MeSP runner, with its helpers. Every
program and batch file flipped, truncated, extended, emptied, swapped for another model's, made a directory or
a FIFO; batches with ids or classes past the model's, non-finite features, torn; hostile flags and output
paths; a program whose step comes out non-finite; SIGKILL at random moments of a run and its save. Each case
ends in a named refusal (exit status 2, 3, 4 or 5 with one sentence naming the file or flag on stderr, nothing
written, every file of the run as it was) or in a result checked against an uninterrupted run or the
ExecuTorch Python runtime. A signal, a hang, exit status 1 or a wrong result fails the case."""
from __future__ import annotations

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
from test_runner_attack import DAMAGE, _damage, _losses, _not_a_file, _run, _snapshot
from test_runner_attack import _refused as mesp_refused

pytest.importorskip("executorch.extension.training", reason="ExecuTorch not installed: pip install 'edgetrain[export]'")
pytest.importorskip("sklearn", reason="the digits stream needs scikit-learn")

from edgetrain.export import export_training, load_trainer, make_trainable, read_batch_file, write_batch_file  # noqa: E402
from edgetrain.export.executorch import PROGRAM_SEAL  # noqa: E402
from edgetrain.export.native import RUNNER, build_runner  # noqa: E402

CLASS = "native runner"
STEPS = 5
LR = 0.3
NAME = "edgetrain_et_runner"


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    if shutil.which("cmake") is None or shutil.which("c++") is None:
        pytest.skip("building the native runner needs cmake and a C++ compiler")
    return build_runner(tmp_path_factory.mktemp("et-attack-build"), target=RUNNER)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """mlp-digits' head over its frozen features, [16, 64] float32 batches and int64 classes, and the bytes of
    its head.weight (to find them in the program)."""
    from edgetrain.data import digits_stream

    directory = tmp_path_factory.mktemp("et-attack-export")
    torch.manual_seed(0)
    model = make_trainable(edgetrain.load_model("mlp-digits"), "head")
    batches = list(itertools.islice(digits_stream(batch_size=16), STEPS))
    program = export_training(model, batches[0], "executorch", directory / "head.pte")
    weight = model.head.weight.detach().contiguous().numpy().tobytes()
    return program, write_batch_file(directory / "batches.bin", batches), batches, weight


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    """A one-block LoRA decoder (vocabulary 256), [2, 16] int64 ids: another model, and one with a vocabulary."""
    import dataclasses

    from edgetrain.data import text_stream
    from edgetrain.models.decoder_presets import tiny_config
    from edgetrain.models.llama import LlamaModel

    directory = tmp_path_factory.mktemp("et-attack-decoder")
    torch.manual_seed(0)
    model = LlamaModel(dataclasses.replace(tiny_config(), num_hidden_layers=1))
    model.init_weights()
    make_trainable(model, "lora", rank=4)
    batches = list(itertools.islice(text_stream(seq_len=16, batch_size=2), STEPS))
    program = export_training(model, batches[0], "executorch", directory / "lora.pte")
    return program, write_batch_file(directory / "batches.bin", batches), batches


def _refused(result: subprocess.CompletedProcess, status: int, *words: str, **options) -> None:
    """The MeSP runner's refusal check (test_runner_attack._refused), for this runner's sentences."""
    mesp_refused(result, status, *words, name=NAME, **options)


@pytest.fixture(scope="module")
def reference(runner, exported, tmp_path_factory):
    """An uninterrupted run of every batch: its losses and saved parameters."""
    program, batch_file, _, _ = exported
    directory = tmp_path_factory.mktemp("et-attack-reference")
    whole = _run(runner, program, batch_file, "--lr", LR, "--save", directory / "whole.safetensors")
    assert whole.returncode == 0, whole.stderr
    return {"losses": _losses(whole.stdout), "saved": (directory / "whole.safetensors").read_bytes()}


@pytest.fixture
def workspace(exported, tmp_path):
    """A copy of the program and batch file to damage, and parameters an earlier run saved (a refused run must
    leave them as they were)."""
    program, batch_file, _, _ = exported
    shutil.copy(program, tmp_path / "head.pte")
    shutil.copy(batch_file, tmp_path / "batches.bin")
    (tmp_path / "kept.safetensors").write_bytes(b"parameters saved by an earlier run")
    return tmp_path


def _command(directory: Path, *extra, program="head.pte", batches="batches.bin"):
    return [directory / program, directory / batches, "--lr", LR, "--save", directory / "kept.safetensors", *extra]


def _python_runtime(program: Path, batches, lr: float = LR) -> list[float]:
    trainer = load_trainer("executorch", program, lr, batches[0])
    return [float(f"{trainer.step(batch):.9g}") for batch in batches]


def _same_trajectory(native: list[float], python: list[float]) -> bool:
    """The same program on the same batch and weights: the first loss bit for bit; later ones to float32
    rounding (the runner's SGD is one fused multiply-add, the Python runtime's optimizer rounds twice)."""
    return len(native) == len(python) and native[:1] == python[:1] and native == pytest.approx(python, abs=1e-5, rel=0)


# -- files that are not files, damaged, or another model's ---------------------------------------------------

@pytest.mark.parametrize("kind", ["directory", "fifo", "empty", "missing", "dangling link"])
@pytest.mark.parametrize("role", ["program", "batches"])
def test_an_input_that_is_not_a_file_is_refused_naming_it(runner, workspace, role, kind):
    path = workspace / {"program": "head.pte", "batches": "batches.bin"}[role]
    if kind == "missing":
        path.unlink()
    else:
        _not_a_file(path, kind)
    before = _snapshot(workspace)
    _refused(_run(runner, *_command(workspace)), 3, path.name, before=before, directory=workspace)


# Where each flip of the program lands: the flatbuffer's root offset, the extended header, the flatbuffer's
# middle (an operator's arguments: without the checksum some trained silently wrong, some aborted inside the
# runtime), the weights segment, and the checksum itself.
PROGRAM_FLIPS = ["flip at 0", "flip at 13", "flip at 1332", "flip at 2775", "flip at 4104", "flip a weight",
                 "flip the checksum", "flip the seal"]


def _flip_program(path: Path, how: str, weight: bytes) -> None:
    data = bytearray(path.read_bytes())
    position = {"flip a weight": data.find(weight) + 5, "flip the checksum": len(data) - 7,
                "flip the seal": len(data) - 16}.get(how) or int(how.split()[-1])
    data[position] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("role, how", [(role, how) for role in ("program", "batches") for how in DAMAGE] +
                         [("program", how) for how in PROGRAM_FLIPS])
def test_a_damaged_input_is_refused_naming_it(runner, workspace, exported, role, how):
    name = {"program": "head.pte", "batches": "batches.bin"}[role]
    if how in PROGRAM_FLIPS:
        _flip_program(workspace / name, how, exported[3])
    else:
        _damage(workspace / name, how)
    before = _snapshot(workspace)
    result = _run(runner, *_command(workspace))
    if role == "batches" and how in ("flip middle", "flip end"):
        # A feature's or class's bits: the file is whole. A class made huge is the program's kernels' to refuse;
        # a feature still finite is a usable batch, trained on as the Python runtime trains on it.
        if result.returncode == 0:
            with fault_tally.checked(CLASS):
                assert _same_trajectory(_losses(result.stdout),
                                        _python_runtime(exported[0], read_batch_file(workspace / name)))
            return
        _refused(result, 3, name, before=before, directory=workspace, steps_first=True)
        return
    _refused(result, 3, name, before=before, directory=workspace)
    if role == "batches":
        fault_tally.refused(CLASS, lambda: read_batch_file(workspace / name), name)


@pytest.mark.parametrize("swap", ["another model's program", "another model's batches",
                                  "the batch file as the program", "the program as the batch file",
                                  "a program exported before the checksum", "a truncated program, resealed",
                                  "an extended program, resealed"])
def test_a_file_swapped_for_another_is_refused(runner, workspace, decoder, swap):
    other_program, other_batches, _ = decoder
    w = workspace
    source, name = {"another model's program": (other_program, "head.pte"),
                    "another model's batches": (other_batches, "batches.bin"),
                    "the batch file as the program": (w / "batches.bin", "head.pte"),
                    "the program as the batch file": (w / "head.pte", "batches.bin"),
                    "a program exported before the checksum": (w / "head.pte", "head.pte"),
                    "a truncated program, resealed": (w / "head.pte", "head.pte"),
                    "an extended program, resealed": (w / "head.pte", "head.pte")}[swap]
    data = Path(source).read_bytes()
    if swap == "a program exported before the checksum":
        assert data[-16:-8] == PROGRAM_SEAL
        data = data[:-16]
    elif "resealed" in swap:  # a checksum that holds over a program its own header does not describe
        data = _reseal(bytearray(data[:-16 - 64] + data[-16:] if "truncated" in swap else data[:-16] + bytes(64) + data[-16:]))
    (w / name).write_bytes(data)
    before = _snapshot(w)
    words = ("do not match",) if swap == "another model's batches" else ()  # found before the kernels
    _refused(_run(runner, *_command(w)), 3, name, *words, before=before, directory=w)


# -- batch files ----------------------------------------------------------------------------------------------

HEADER = 8 + 4 + (8 + 16) + (8 + 8) + 8  # float32 [16, 64] features, int64 [16] classes
BATCH = 16 * 64 * 4 + 16 * 8


def _batch_file(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    classes = HEADER + 16 * 64 * 4
    {
        "magic": lambda: data.__setitem__(slice(0, 8), b"EDGEBAT2"),
        "three tensors a batch": lambda: struct.pack_into("<I", data, 8, 3),
        "dtype code 2": lambda: struct.pack_into("<I", data, 12, 2),
        "int64 features": lambda: struct.pack_into("<I", data, 12, 1),
        "ndim 9": lambda: struct.pack_into("<I", data, 16, 9),
        "a negative dimension": lambda: struct.pack_into("<q", data, 20, -16),
        "a dimension of 2^40": lambda: struct.pack_into("<q", data, 20, 1 << 40),
        "dims whose product wraps": lambda: struct.pack_into("<qq", data, 20, 1 << 62, 4),
        "2^63 batches announced": lambda: struct.pack_into("<Q", data, HEADER - 8, 1 << 63),
        "6 batches announced, 5 held": lambda: struct.pack_into("<Q", data, HEADER - 8, STEPS + 1),
        "0 batches announced": lambda: struct.pack_into("<Q", data, HEADER - 8, 0),
        "a torn last batch": lambda: data.__delitem__(slice(len(data) - 100, None)),
        "half a batch more": lambda: data.extend(bytes(BATCH // 2)),
        "a NaN feature": lambda: struct.pack_into("<f", data, HEADER + 4 * 70, float("nan")),
        "an infinite feature in the last batch": lambda: struct.pack_into("<f", data, len(data) - BATCH, float("inf")),
        "a class of -1": lambda: struct.pack_into("<q", data, classes + 8 * 3, -1),
        "a class of -5 in the last batch": lambda: struct.pack_into("<q", data, len(data) - 8, -5),
        "a class of 10 (of 10)": lambda: struct.pack_into("<q", data, classes + 8 * 3, 10),
        "a class of 2^62 in the last batch": lambda: struct.pack_into("<q", data, len(data) - 8, 1 << 62),
    }[how]()
    path.write_bytes(bytes(data))


# Refused when the program's kernels reach the batch: the steps before it are printed, nothing is written.
KERNEL_REFUSED = {"a class of 10 (of 10)", "a class of 2^62 in the last batch"}
BATCH_DAMAGE = ["magic", "three tensors a batch", "dtype code 2", "int64 features", "ndim 9", "a negative dimension",
                "a dimension of 2^40", "dims whose product wraps", "2^63 batches announced",
                "6 batches announced, 5 held", "0 batches announced", "a torn last batch", "half a batch more",
                "a NaN feature", "an infinite feature in the last batch", "a class of -1",
                "a class of -5 in the last batch", *sorted(KERNEL_REFUSED)]


@pytest.mark.parametrize("how", BATCH_DAMAGE)
def test_a_hostile_batch_file_is_refused(runner, workspace, how):
    path = workspace / "batches.bin"
    _batch_file(path, how)
    before = _snapshot(workspace)
    result = _run(runner, *_command(workspace))
    _refused(result, 3, "batches.bin", before=before, directory=workspace, steps_first=how in KERNEL_REFUSED)
    if how in KERNEL_REFUSED:
        assert "batch 0" in result.stderr if "last" not in how else "batch 4" in result.stderr


@pytest.mark.parametrize("how", ["an id of 256 (of 256)", "an id of -1", "an id of 2^40 in the last batch",
                                 "a target of 256", "a target of -2", "int64 ids as float32"])
def test_ids_outside_the_vocabulary_are_refused(runner, decoder, tmp_path, how):
    program, batch_file, _ = decoder
    path = tmp_path / "ids.bin"
    data = bytearray(Path(batch_file).read_bytes())
    header = 8 + 4 + 2 * (8 + 16) + 8  # two int64 [2, 16] tensors
    {"an id of 256 (of 256)": lambda: struct.pack_into("<q", data, header + 8 * 7, 256),
     "an id of -1": lambda: struct.pack_into("<q", data, header + 8 * 7, -1),
     "an id of 2^40 in the last batch": lambda: struct.pack_into("<q", data, len(data) - 512, 1 << 40),
     "a target of 256": lambda: struct.pack_into("<q", data, header + 256 + 8, 256),
     "a target of -2": lambda: struct.pack_into("<q", data, header + 256 + 8, -2),
     "int64 ids as float32": lambda: struct.pack_into("<I", data, 12, 0)}[how]()
    path.write_bytes(bytes(data))
    (tmp_path / "kept.safetensors").write_bytes(b"earlier")
    before = _snapshot(tmp_path)
    result = _run(runner, program, path, "--save", tmp_path / "kept.safetensors")
    _refused(result, 3, "ids.bin", before=before, directory=tmp_path, steps_first="256" in how or "2^40" in how)


def test_ignored_targets_train_as_the_python_runtime(runner, decoder, tmp_path):
    """-100 is the ignored position of edgetrain's losses: a usable batch, trained on as the runtime does."""
    program, batch_file, _ = decoder
    data = bytearray(Path(batch_file).read_bytes())
    struct.pack_into("<4q", data, 8 + 4 + 2 * (8 + 16) + 8 + 256 + 8 * 4, -100, -100, -100, -100)
    path = tmp_path / "ignored.bin"
    path.write_bytes(bytes(data))
    with fault_tally.checked(CLASS):
        result = _run(runner, program, path, "--lr", LR)
        assert result.returncode == 0, result.stderr
        assert _same_trajectory(_losses(result.stdout), _python_runtime(program, read_batch_file(path)))


# -- a step that comes out non-finite -------------------------------------------------------------------------

def _reseal(data: bytearray) -> bytes:
    body = bytes(data[:-16])
    return body + PROGRAM_SEAL + struct.pack("<II", zlib.crc32(body), 0)


@pytest.mark.parametrize("how", ["head.weight 3e38 (logits overflow)", "head.weight NaN"])
def test_a_step_that_comes_out_non_finite_saves_nothing(runner, workspace, exported, how):
    """A program whose weights are forged (and resealed) to overflow: the first step is not finite, exit 5."""
    data = bytearray((workspace / "head.pte").read_bytes())
    at = data.find(exported[3])
    value = 3e38 if "3e38" in how else float("nan")
    data[at:at + len(exported[3])] = struct.pack("<f", value) * (len(exported[3]) // 4)
    (workspace / "head.pte").write_bytes(_reseal(data))
    before = _snapshot(workspace)
    _refused(_run(runner, *_command(workspace)), 5, "batch 0", "not finite", before=before, directory=workspace)


# -- flags and output paths -----------------------------------------------------------------------------------

FLAGS = {
    "--lr nan": ["--lr", "nan"], "--lr inf": ["--lr", "inf"], "--lr -inf": ["--lr", "-inf"],
    "--lr 1e309": ["--lr", "1e309"], "--lr -1": ["--lr", "-1"], "--lr 1e7": ["--lr", "1e7"], "--lr ''": ["--lr", ""],
    "--lr ' 1'": ["--lr", " 1"], "--lr 0.1x": ["--lr", "0.1x"], "--lr '0.1 '": ["--lr", "0.1 "],
    "--lr given twice": ["--lr", "0.1", "--lr", "0.2"], "--lr without a value": ["--lr"],
    "--steps 0": ["--steps", "0"], "--steps -1": ["--steps", "-1"], "--steps 1.5": ["--steps", "1.5"],
    "--steps 12abc": ["--steps", "12abc"], "--steps 1e3": ["--steps", "1e3"], "--steps +2": ["--steps", "+2"],
    "--steps 99999999999999999999": ["--steps", "99999999999999999999"],
    "--steps 18446744073709551616": ["--steps", "18446744073709551616"], "--steps ''": ["--steps", ""],
    "--steps twice": ["--steps", "1", "--steps", "2"], "--unknown": ["--unknown", "1"], "-x": ["-x"],
    "--beta1 (the MeSP runner's)": ["--beta1", "0.9"], "--save without a value": ["--save"],
    "--save --steps 1 (value forgotten)": ["--save", "--steps", "1"], "--save ''": ["--save", ""],
    "a third positional": ["extra.bin"],
}


@pytest.mark.parametrize("case", list(FLAGS))
def test_a_hostile_flag_is_refused_naming_it(runner, exported, tmp_path, monkeypatch, case):
    program, batch_file, _, _ = exported
    monkeypatch.chdir(tmp_path)  # a flag misread as a path must not leave a file here
    flag = FLAGS[case][0]
    result = _run(runner, program, batch_file, *FLAGS[case])
    _refused(result, 2, *([flag] if flag.startswith("-") else []), before={}, directory=tmp_path)


def test_more_steps_than_batches_is_refused(runner, workspace):
    before = _snapshot(workspace)
    _refused(_run(runner, *_command(workspace, "--steps", STEPS + 1)), 3, "batches.bin", "--steps",
             before=before, directory=workspace)


@pytest.mark.parametrize("case", ["--save the program", "--save the batch file", "--save a link to the program",
                                  "--save whose temporary is the batch file", "--save the program by another path",
                                  "--save a hard link to the batch file"])
def test_an_output_over_an_input_is_refused(runner, workspace, case):
    w = workspace
    batches = w / "batches.bin"
    if case == "--save whose temporary is the batch file":
        batches = batches.rename(w / "b.tmp")
    if case == "--save a link to the program":
        (w / "link.safetensors").symlink_to(w / "head.pte")
    if case == "--save a hard link to the batch file":
        os.link(batches, w / "hard.safetensors")
    save = {"--save the program": w / "head.pte", "--save the batch file": w / "batches.bin",
            "--save a link to the program": w / "link.safetensors", "--save whose temporary is the batch file": w / "b",
            "--save the program by another path": w / "." / ".." / w.name / "head.pte",
            "--save a hard link to the batch file": w / "hard.safetensors"}[case]
    before = _snapshot(w)
    _refused(_run(runner, w / "head.pte", batches, "--save", save), 2, "--save", before=before, directory=w)


@pytest.mark.parametrize("kind", ["directory", "fifo", "a missing directory"])
def test_an_output_that_cannot_be_a_file_is_refused(runner, workspace, kind):
    path = workspace / "kept.safetensors"
    path.unlink()
    if kind == "directory":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        path = workspace / "nowhere" / "out.safetensors"
    before = _snapshot(workspace)
    _refused(_run(runner, workspace / "head.pte", workspace / "batches.bin", "--save", path), 4, path.name,
             before=before, directory=workspace)


def test_a_read_only_directory_is_refused_and_the_file_kept(runner, workspace):
    disk = workspace / "ro"
    disk.mkdir()
    (disk / "out.safetensors").write_bytes(b"earlier")
    if os.geteuid() == 0:  # root writes through permission bits: a read-only mount then
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], capture_output=True)
        if mounted.returncode != 0:
            pytest.skip("root, and no mount to make a read-only directory with")
        (disk / "out.safetensors").write_bytes(b"earlier")
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
    else:
        disk.chmod(0o555)
    try:
        before = _snapshot(disk)
        result = _run(runner, workspace / "head.pte", workspace / "batches.bin", "--save", disk / "out.safetensors")
        _refused(result, 4, "out.safetensors", before=before, directory=disk)
    finally:
        if os.geteuid() == 0:
            subprocess.run(["umount", "-l", str(disk)], capture_output=True)
        else:
            disk.chmod(0o755)


@pytest.mark.parametrize("flags", [("--lr", "0"), ("--lr", "1e6"), ("--steps", "1")])
def test_edge_flags_that_are_valid_train_as_the_python_runtime(runner, exported, tmp_path, flags):
    program, batch_file, batches, _ = exported
    options = dict(zip(flags[::2], flags[1::2]))
    lr = float(options.get("--lr", LR))
    with fault_tally.checked(CLASS):
        result = _run(runner, program, batch_file, *(flags if "--lr" in options else ("--lr", LR, *flags)))
        assert result.returncode == 0, result.stderr
        expected = _python_runtime(program, batches[:int(options.get("--steps", STEPS))], lr)
        assert _same_trajectory(_losses(result.stdout), expected)


def test_a_stale_temporary_of_a_killed_save_is_replaced(runner, workspace, reference):
    (workspace / "kept.safetensors.tmp").write_bytes(b"half a save")
    with fault_tally.checked(CLASS):
        result = _run(runner, *_command(workspace))
        assert result.returncode == 0, result.stderr
        assert (workspace / "kept.safetensors").read_bytes() == reference["saved"]
        assert not (workspace / "kept.safetensors.tmp").exists()


# -- SIGKILL at random moments --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def run_seconds(runner, exported, tmp_path_factory):
    program, batch_file, _, _ = exported
    directory = tmp_path_factory.mktemp("et-attack-timing")
    started = time.monotonic()
    _run(runner, program, batch_file, "--lr", LR, "--save", directory / "a")
    return time.monotonic() - started


def _kill_and_rerun(runner, exported, reference, directory: Path, delays: list[float]) -> None:
    """Runs killed after each of `delays` seconds (including during the save): the saved parameters are at
    every moment the earlier file or the whole new one; a rerun ends with the uninterrupted run's bytes."""
    program, batch_file, _, _ = exported
    saved = directory / "params.safetensors"
    earlier = b"parameters an earlier run saved"
    saved.write_bytes(earlier)
    command = [str(runner), str(program), str(batch_file), "--lr", repr(LR), "--save", str(saved)]
    for delay in delays:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                   env={**os.environ, "OMP_NUM_THREADS": "1"})
        time.sleep(delay)
        process.send_signal(signal.SIGKILL)
        process.wait()
        assert saved.read_bytes() in (earlier, reference["saved"])
        if process.returncode == 0:
            saved.write_bytes(earlier)
    finished = _run(runner, *command[1:])
    assert finished.returncode == 0, finished.stderr
    assert saved.read_bytes() == reference["saved"]
    assert _losses(finished.stdout) == reference["losses"]


@pytest.mark.parametrize("seed", range(6))
def test_a_run_killed_at_a_random_moment_leaves_the_old_file(runner, exported, reference, run_seconds, tmp_path,
                                                             seed):
    rng = random.Random(seed)
    delays = [rng.uniform(0, run_seconds * 1.2) for _ in range(1 + seed % 3)]
    with fault_tally.checked(CLASS):
        _kill_and_rerun(runner, exported, reference, tmp_path, delays)


def test_the_saved_parameters_are_the_python_runtimes(runner, exported, reference, tmp_path):
    """The reference itself, checked: the runner's losses are the ExecuTorch Python runtime's."""
    program, batch_file, batches, _ = exported
    with fault_tally.checked(CLASS):
        assert _same_trajectory(reference["losses"], _python_runtime(program, batches))
