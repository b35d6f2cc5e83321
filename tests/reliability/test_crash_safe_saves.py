"""Every file edgetrain writes to a user's path is either the complete new one or the intact old one.

For each writer, over a good file (or directory) from an earlier save:
  * a write that fails part-way (an exception raised from inside it), and
  * a process killed by SIGKILL in the middle of the write
leave the old one byte for byte, still loadable by edgetrain's own loader, with no partial file at the final
path; the next save of the same path succeeds and removes the temp files the killed writer left.

Where the fault strikes:
  torn-write       the first write to the target, into it (a directory) or into a temp sibling of it
                   (.NAME.*) writes half of its bytes, then fails: where an in-place writer has already
                   destroyed the old file.
  torn-second-file (directories) the same for the second file written: the first is complete, so files
                   written one by one would now be a mismatched set (new weights, old config).
  between-renames  (directories) the rename that puts the new directory in place, after the old one was
                   moved aside: the one moment when the final path does not exist.

Killed writers run in a forked child. MLX cannot compute in a child forked from a process that has already
run MLX (its scheduler threads are not in the child), so MLX writers run in children of a fork server that
has only imported it. Damage after writing is the checksum's job; it covers the metadata as well.
"""
from __future__ import annotations

import builtins
import dataclasses
import importlib.util
import io
import json
import multiprocessing
import os
import shutil
import signal
import socket
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch

import edgetrain
from edgetrain.training.checkpoint import (CorruptCheckpointError, LEGACY_CHECKSUM_KEY, atomic_save_safetensors,
                                  load_safetensors_checked, readable_directory, tensors_sha256)
from edgetrain.data.batch import Batch
from edgetrain.training.learner import Learner
from fault_tally import checked

pytestmark = pytest.mark.usefixtures("one_thread")


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False


NEEDS = {
    "mlx": ("mlx.core", "mlx is not installed (pip install 'edgetrain[mlx]')"),
    "executorch": ("executorch", "ExecuTorch is not installed (pip install 'edgetrain[export]')"),
    "onnxruntime": ("onnxruntime.training", "onnxruntime-training is not installed (pip install 'edgetrain[export]')"),
    "matplotlib": ("matplotlib", "matplotlib is not installed (pip install matplotlib)"),
}


# -- the writers ----------------------------------------------------------------------------------
# write(out, seed) saves something that depends on `seed` at `out`; load(out) reads it with edgetrain's own
# reader and raises if it cannot.

def _mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return edgetrain.load_model("mlp-digits")


def _features(model: torch.nn.Module) -> Batch:
    from edgetrain.export import example_batch

    return example_batch(model, 4, 8, seed=0)


def _learner(seed: int) -> Learner:
    model = _mlp(seed)
    learner = Learner(model, method="bp", optimizer="adamw", lr=1e-2)
    learner.step(_features(model))  # so that the optimizer state is in the checkpoint too
    return learner


def _tiny_lora(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = edgetrain.add_lora(edgetrain.load_model("tiny"), rank=2)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("lora_B"):
                param.normal_(0, 0.02)
    return model


def _mlx_lora(seed: int):
    from edgetrain.backends.mlx.loading import load_mlx_model
    from edgetrain.backends.mlx.lora import add_lora

    return add_lora(load_mlx_model("tiny", seed=seed), rank=2)


def _mlx_learner(seed: int):
    from edgetrain.training.learner import Learner
    from edgetrain.data.text import TextStream

    learner = Learner(_mlx_lora(seed), backend="mlx", method="bp", optimizer="adamw", lr=1e-2)
    learner.step(TextStream(seq_len=8, batch_size=1).batch(seed))
    return learner


def _head(seed: int) -> torch.nn.Module:
    from edgetrain.export import make_trainable

    model = _mlp(seed)
    make_trainable(model, "head")
    return model


def _export(runtime: str, out: Path, seed: int) -> None:
    from edgetrain.export import export_training

    model = _head(seed)
    export_training(model, _features(model), runtime, out)


def _train_exported(runtime: str, out: Path) -> None:
    from edgetrain.export import load_trainer

    batch = _features(_head(0))
    assert load_trainer(runtime, out, lr=0.1, batch=batch).step(batch) > 0


def _profile_records(seed: int) -> list[dict[str, Any]]:
    return [{"method": method, "backend": "torch-cpu", "model": "tiny", "seq": 8, "batch": 1, "rank": 2,
             "peak_bytes_probe": 2**20 * (index + 1 + seed), "peak_bytes_tensors": 2**19 * (index + 1),
             "step_seconds": 0.01 * (index + 1), "loss": 2.5, "grad_cosine": 1.0, "grad_max_rel_err": 0.0,
             "probe": "linux"} for index, method in enumerate(("bp", "mesp"))]


def _load_profile_json(out: Path) -> None:
    from edgetrain.profiler.config import RECORD_FIELDS

    records = json.loads(out.read_text())
    assert records and all(field in record for record in records for field in RECORD_FIELDS)


def _batches(seed: int) -> list[Batch]:
    generator = torch.Generator().manual_seed(seed)
    return [Batch(torch.randn(2, 3, generator=generator), torch.randint(0, 4, (2,), generator=generator), i)
            for i in range(3)]


@contextmanager
def _one_process_group() -> Iterator[None]:
    """The torchrun environment of a world of one, on a free localhost port; the group is gone afterwards
    even when the run inside fails."""
    import torch.distributed as dist

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    saved = dict(os.environ)
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(saved)


def _scpl_report(out: Path, seed: int) -> None:
    from edgetrain.recipes import scpl_pipeline

    with _one_process_group():
        scpl_pipeline.main(["--model", "convnet-digits", "--data", "random", "--batch", "4", "--steps", "1",
                            "--seed", str(seed), "--device", "cpu", "--report", str(out),
                            "--save", str(out.with_suffix(".safetensors"))])


def _ddp_segprop_report(out: Path, seed: int) -> None:
    from edgetrain.recipes import ddp_segprop

    resnet = {"in_channels": 1, "width": 4, "norm": "group", "blocks_per_stage": [1, 1], "num_classes": 10}
    with _one_process_group():
        ddp_segprop.main(["--resnet", json.dumps(resnet), "--data", "digits",
                          "--data-options", json.dumps({"image": True, "shuffle": False}), "--batch-size", "4",
                          "--steps-per-stage", "1", "--optimizer", "sgd", "--seed", str(seed), "--backend", "gloo",
                          "--method-options", json.dumps({"segments": 1, "head_blocks": 0}),
                          "--out", str(out.with_suffix(".safetensors"))])


def _subnet_data(out: Path, seed: int) -> None:
    from edgetrain.recipes.subnet_dp.run import save_data_file

    save_data_file(out, "random-cifar", train_limit=8, seed=seed)


def _load_subnet_data(out: Path) -> None:
    from edgetrain.recipes.subnet_dp.run import load_data

    (train_x, _), _ = load_data("random-cifar", data_file=out)
    assert train_x.shape == (8, 3, 32, 32)


def _subnet_report(out: Path, seed: int) -> None:
    from edgetrain.recipes.subnet_dp import run

    data = out.parent / "data.pt"
    if not data.exists():
        run.save_data_file(data, "random-cifar", train_limit=8)
    with _one_process_group():
        run.main(["--data-file", str(data), "--dataset", "random-cifar", "--masking", "neuron", "--overlap", "1",
                  "--max-steps", "1", "--batch-size", "4", "--width", "2", "--blocks", "1", "--no-eval",
                  "--model-seed", str(seed), "--json", str(out)])


def _subnet_selfcheck(out: Path, seed: int) -> None:
    import subnet_selfcheck as selfcheck

    with _one_process_group():
        selfcheck.main(["--maskings", "neuron", "--overlap", "1", "--steps", "1", "--batch-size", "2",
                        "--width", str(2 * (1 + seed)), "--no-ddp", "--json", str(out)])


def _load_json(out: Path) -> None:
    assert json.loads(out.read_text())


def _write_lora(out: Path, seed: int) -> None:
    edgetrain.save_lora(_tiny_lora(seed), out)


def _load_lora(out: Path) -> None:
    edgetrain.load_lora(edgetrain.load_model("tiny"), out)


def _write_mlx_lm(out: Path, seed: int) -> None:
    from edgetrain.backends.mlx.adapters import save_mlx_lm_adapters

    save_mlx_lm_adapters(_mlx_lora(seed), out)


def _load_mlx_lm(out: Path) -> None:
    from edgetrain.backends.mlx.adapters import load_mlx_lm_adapters
    from edgetrain.backends.mlx.loading import load_mlx_model

    load_mlx_lm_adapters(load_mlx_model("tiny"), out)


def _torch_to_mlx_lm(out: Path, seed: int) -> None:
    from edgetrain.backends.mlx.adapters import torch_adapter_to_mlx_lm

    source = out.parent / f"torch-adapter-{seed}.safetensors"
    edgetrain.save_lora(_tiny_lora(seed), source)
    torch_adapter_to_mlx_lm(source, out)


def _mlx_lm_to_torch(out: Path, seed: int) -> None:
    from edgetrain.backends.mlx.adapters import mlx_lm_to_torch_adapter, save_mlx_lm_adapters

    source = out.parent / f"mlx-adapter-{seed}"
    save_mlx_lm_adapters(_mlx_lora(seed), source)
    mlx_lm_to_torch_adapter(source, out)


def _write_plot(out: Path, seed: int) -> None:
    from edgetrain.profiler.report import write_plot

    write_plot(_profile_records(seed), out)


def _load_plot(out: Path) -> None:
    import matplotlib.image

    assert matplotlib.image.imread(out).shape[-1] in (3, 4)


def _write_rotating(out: Path, seed: int) -> None:
    learner = _learner(seed)
    learner.steps_done = seed + 1  # seed 0 writes step-1, seed 1 step-2
    learner.save_rotating(out, keep=1)


def _load_rotating(out: Path) -> None:
    assert _learner(0).resume(out) is not None


@dataclasses.dataclass(frozen=True)
class Writer:
    name: str
    filename: str
    write: Callable[[Path, int], None]
    load: Callable[[Path], None]
    directory: bool = False     # writes a directory as one unit
    needs: tuple[str, ...] = ()
    # The file the faulty save (seed 1) writes, and the file or directory that must survive it.
    target: Callable[[Path], Path] = lambda out: out
    guarded: Callable[[Path], Path] = lambda out: out

    @property
    def mlx(self) -> bool:
        return "mlx" in self.needs


WRITERS = {w.name: w for w in [
    Writer("learner-save", "learner.safetensors", lambda out, seed: _learner(seed).save(out),
           lambda out: _learner(0).load(out)),
    Writer("learner-save-rotating", "ckpt", _write_rotating, _load_rotating,
           target=lambda out: out / "step-00000002.safetensors", guarded=lambda out: out / "step-00000001.safetensors"),
    Writer("save-lora", "adapter.safetensors", _write_lora, _load_lora),
    Writer("mlx-learner-save", "mlx-learner.safetensors", lambda out, seed: _mlx_learner(seed).save(out),
           lambda out: _mlx_learner(0).load(out), needs=("mlx",)),
    Writer("save-mlx-lm-adapters", "adapters", _write_mlx_lm, _load_mlx_lm, directory=True, needs=("mlx",)),
    Writer("torch-adapter-to-mlx-lm", "converted", _torch_to_mlx_lm, _load_mlx_lm, directory=True, needs=("mlx",)),
    Writer("mlx-lm-to-torch-adapter", "back.safetensors", _mlx_lm_to_torch, _load_lora, needs=("mlx",)),
    Writer("export-executorch", "head.pte", lambda out, seed: _export("executorch", out, seed),
           lambda out: _train_exported("executorch", out), needs=("executorch",)),
    Writer("export-onnxruntime", "head-ort", lambda out, seed: _export("onnxruntime", out, seed),
           lambda out: _train_exported("onnxruntime", out), directory=True, needs=("onnxruntime",)),
    Writer("batch-stream-file", "batches.bin",
           lambda out, seed: edgetrain.export.write_batch_file(out, _batches(seed)),
           lambda out: edgetrain.export.read_batch_file(out)),
    Writer("profile-json", "profile.json",
           lambda out, seed: edgetrain.profiler.report.write_json(_profile_records(seed), out), _load_profile_json),
    Writer("profile-plot", "profile.png", _write_plot, _load_plot, needs=("matplotlib",)),
    Writer("scpl-pipeline-report", "scpl.json", _scpl_report, _load_json),
    Writer("ddp-segprop-report", "ddp.json", _ddp_segprop_report, _load_json),
    Writer("subnet-run-json", "subnet.json", _subnet_report, _load_json),
    Writer("subnet-selfcheck-json", "selfcheck.json", _subnet_selfcheck, _load_json),
    Writer("subnet-data-file", "data.pt", _subnet_data, _load_subnet_data),
]}

import edgetrain.export  # noqa: E402  (the lambdas above reach it as an attribute)
import edgetrain.profiler.report  # noqa: E402


def _param(name: str, *rest: str):
    writer = WRITERS[name]
    marks = [pytest.mark.skipif(not _installed(NEEDS[need][0]), reason=NEEDS[need][1]) for need in writer.needs]
    return pytest.param(name, *rest, marks=marks, id="-".join((name, *rest)))


FAULTS = [_param(name, "torn-write") for name in WRITERS] + \
         [_param(name, fault) for name, w in WRITERS.items() if w.directory
          for fault in ("torn-second-file", "between-renames")]


# -- faults ---------------------------------------------------------------------------------------

class InjectedFault(BaseException):
    """Raised from inside a write. A BaseException (as KeyboardInterrupt is), so no `except Exception` in a
    writer can hide it."""


def _belongs_to(path: Any, target: Path) -> bool:
    """`path` is the target, inside it, a temp sibling of it (.NAME.*), or inside one of those."""
    try:
        first = Path(os.path.abspath(path)).relative_to(target.parent).parts[0]
    except (TypeError, ValueError, IndexError):
        return False
    return first == target.name or first.startswith(f".{target.name}.")


class _TornFile:
    """A file whose first write stores half of its bytes, then fails."""

    def __init__(self, handle: Any, fail: Callable[[], object]) -> None:
        self._handle, self._fail = handle, fail

    def write(self, data: Any) -> int:
        self._handle.write(data[:len(data) // 2])
        self._handle.flush()
        self._fail()
        raise AssertionError("the fault did not stop the write")

    def __enter__(self) -> "_TornFile":
        return self

    def __exit__(self, *exc: Any) -> None:
        self._handle.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle, name)


def _install_fault(fault: str, target: Path, fail: Callable[[], None], patch: Callable[[Any, str, Any], None]) -> None:
    """Make the first (torn-write) or second (torn-second-file) file written for `target`, or the rename
    onto it (between-renames), call `fail`; later ones, such as a writer's own rollback, go through."""
    fired: list[bool] = []
    opened: list[Any] = []

    def fail_once() -> bool:
        if fired:
            return False
        fired.append(True)
        fail()
        return True

    if fault in ("torn-write", "torn-second-file"):
        real_open = io.open
        nth = 1 if fault == "torn-write" else 2

        def opener(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
            handle = real_open(file, mode, *args, **kwargs)
            if not fired and any(flag in mode for flag in "wax+") and _belongs_to(file, target):
                opened.append(file)
                if len(opened) == nth:
                    return _TornFile(handle, fail_once)
            return handle

        patch(builtins, "open", opener)
        patch(io, "open", opener)  # pathlib's write_text / write_bytes
    else:
        real_replace = os.replace

        def replace(source: Any, destination: Any, *args: Any, **kwargs: Any) -> None:
            if Path(os.path.abspath(destination)) == target:
                fail_once()
            real_replace(source, destination, *args, **kwargs)

        patch(os, "replace", replace)


def _raise() -> None:
    raise InjectedFault


def _killed_child(name: str, out: str, fault: str, conn: Any) -> None:
    """Runs in a child: the faulty save, which kills this process (SIGKILL) at the fault point."""
    writer = WRITERS[name]
    torch.set_num_threads(1)

    def kill() -> None:
        conn.send("reached")
        os.kill(os.getpid(), signal.SIGKILL)

    _install_fault(fault, writer.target(Path(out)), kill, setattr)
    writer.write(Path(out), 1)
    conn.send("finished without reaching the fault point")


def _kill_mid_save(writer: Writer, out: Path, fault: str) -> None:
    if writer.mlx:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload([__name__, "mlx.core", "edgetrain.backends.mlx.learner",
                                        "edgetrain.backends.mlx.adapters"])
    else:
        context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_killed_child, args=(writer.name, str(out), fault, send))
    child.start()
    send.close()
    child.join(timeout=240)
    if child.exitcode is None:
        child.kill()
        child.join()
        pytest.fail(f"{writer.name}: the child saving {out} hung")
    messages = []
    while True:  # the child is gone: every message it sent is there, then the end of the pipe
        try:
            messages.append(receive.recv())
        except EOFError:
            break
    assert (child.exitcode, messages) == (-signal.SIGKILL, ["reached"]), \
        f"{writer.name}: the child was to die at the {fault} fault; exit {child.exitcode}, said {messages}"


# -- checks ---------------------------------------------------------------------------------------

def _snapshot(path: Path) -> dict[str, bytes]:
    if path.is_dir():
        return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}
    return {"": path.read_bytes()} if path.is_file() else {}


def _leftovers(target: Path) -> list[str]:
    return sorted(p.name for p in target.parent.iterdir() if p.name.startswith(f".{target.name}."))


def _assert_old_intact(writer: Writer, out: Path, old: dict[str, bytes]) -> None:
    guarded = writer.guarded(out)
    # Directories are read through readable_directory, as edgetrain's readers do (after a kill between the
    # swap's renames the old version is complete under .NAME.old).
    where = readable_directory(guarded) if writer.directory else guarded
    assert _snapshot(where) == old, f"{writer.name}: the previous save at {guarded} was changed"
    writer.load(out)
    target = writer.target(out)
    if target != guarded:
        assert not target.exists(), f"{writer.name}: a partial {target.name} is at the final path"


@pytest.fixture(scope="module")
def first_save(tmp_path_factory) -> Callable[[Writer], Path]:
    """A directory holding one good save (seed 0) per writer, made once per module and copied per test."""
    made: dict[str, Path] = {}

    def get(writer: Writer) -> Path:
        if writer.name not in made:
            root = tmp_path_factory.mktemp(writer.name)
            writer.write(root / writer.filename, 0)
            made[writer.name] = root
        return made[writer.name]
    return get


# A file of the user's in a directory edgetrain writes: every save, even one after a crash, must keep it.
USER_FILE = "notes.txt"


def _over_a_good_save(writer: Writer, first_save: Callable[[Writer], Path],
                      tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    root = tmp_path / "saves"
    shutil.copytree(first_save(writer), root, symlinks=True)
    out = root / writer.filename
    if writer.directory:
        (out / USER_FILE).write_text("the user's own file")
    old = _snapshot(writer.guarded(out))
    assert old, f"{writer.name}: the first save wrote nothing at {writer.guarded(out)}"
    return out, old


# -- the tests ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, fault", FAULTS)
def test_a_save_that_fails_part_way_keeps_the_previous_one(name, fault, first_save, tmp_path, monkeypatch):
    writer = WRITERS[name]
    out, old = _over_a_good_save(writer, first_save, tmp_path)
    with monkeypatch.context() as patched:
        _install_fault(fault, writer.target(out), _raise, patched.setattr)
        try:
            writer.write(out, 1)
        except InjectedFault:
            pass
        else:
            pytest.fail(f"{writer.name}: the save never reached the {fault} fault point: it no longer writes "
                        "through Python's open() and os.replace, so its atomicity is not checked here")
    with checked("kills and crashes"):
        _assert_old_intact(writer, out, old)
        # A failure the writer sees is cleaned up at once.
        assert _leftovers(writer.target(out)) == []


@pytest.mark.parametrize("name, fault", FAULTS)
def test_a_save_killed_mid_write_keeps_the_previous_one(name, fault, first_save, tmp_path):
    writer = WRITERS[name]
    out, old = _over_a_good_save(writer, first_save, tmp_path)
    _kill_mid_save(writer, out, fault)
    with checked("kills and crashes"):
        _assert_old_intact(writer, out, old)
    # The killed writer's temp files stay until the next save of the same path, which removes them.
    writer.write(out, 1)
    writer.load(out)
    assert _snapshot(writer.target(out)), f"{writer.name}: the next save wrote nothing"
    assert _leftovers(writer.target(out)) == [], f"{writer.name}: the next save left the killed save's temp files"
    if writer.directory:
        assert (out / USER_FILE).read_text() == "the user's own file"


def test_a_directory_save_keeps_files_it_does_not_write(tmp_path):
    """Swapping in a new directory must not drop a user's other files in it (mlx-lm's own checkpoints)."""
    from edgetrain.training.checkpoint import atomic_write_directory

    out = tmp_path / "adapters"
    out.mkdir()
    (out / "0000100_adapters.safetensors").write_bytes(b"mlx-lm's checkpoint")
    (out / "notes").mkdir()
    (out / "notes" / "run.txt").write_text("lr 1e-4")
    atomic_write_directory(out, lambda new: (new / "adapter_config.json").write_text("{}"))
    assert _snapshot(out) == {"0000100_adapters.safetensors": b"mlx-lm's checkpoint", "adapter_config.json": b"{}",
                              "notes/run.txt": b"lr 1e-4"}


# -- checksums ------------------------------------------------------------------------------------

def _header_span(raw: bytes) -> tuple[int, int]:
    return 8, 8 + int.from_bytes(raw[:8], "little")


def _flip_payload_byte(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    _, end = _header_span(raw)
    raw[end + (len(raw) - end) // 2] ^= 0x01
    path.write_bytes(bytes(raw))


def _change_metadata_digit(path: Path, marker: bytes) -> None:
    """Turn the first digit after `marker` in the header into another digit: still valid JSON, the kind
    of damage only a checksum of the metadata can see."""
    raw = bytearray(path.read_bytes())
    start, end = _header_span(raw)
    position = raw.index(marker, start, end) + len(marker)
    while not chr(raw[position]).isdigit():
        position += 1
    raw[position] = ord("7") if raw[position] != ord("7") else ord("3")
    path.write_bytes(bytes(raw))


# name: (write, load, the metadata value to damage: it sits inside a JSON string, hence the escaped quote)
CHECKSUMMED = {
    "learner": (lambda path: _learner(1).save(path), lambda path: _learner(0).load(path), b'steps_done\\": '),
    "lora-adapter": (lambda path: _write_lora(path, 1), _load_lora, b'rank\\": '),
    "mlx-learner": (lambda path: _mlx_learner(1).save(path), lambda path: _mlx_learner(0).load(path),
                    b'steps_done\\": '),
}


def _checksummed(name: str):
    marks = [pytest.mark.skipif(not _installed("mlx.core"), reason=NEEDS["mlx"][1])] if name.startswith("mlx") else []
    return pytest.param(name, marks=marks, id=name)


@pytest.mark.parametrize("name", [_checksummed(n) for n in CHECKSUMMED])
@pytest.mark.parametrize("damage", ["tensor-payload", "metadata-value"])
def test_a_damaged_byte_is_refused_on_load(name, damage, tmp_path):
    write, load, marker = CHECKSUMMED[name]
    path = tmp_path / "saved.safetensors"
    write(path)
    load(path)
    if damage == "tensor-payload":
        _flip_payload_byte(path)
    else:
        _change_metadata_digit(path, marker)
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        load(path)


def _rotating_pair(directory: Path) -> Path:
    """step-1 (a learner of seed 0) and step-2 (seed 1) in `directory`; returns step-2."""
    for seed in (0, 1):
        learner = _learner(seed)
        learner.steps_done = seed + 1
        learner.save_rotating(directory, keep=2)
    return directory / "step-00000002.safetensors"


def _state_json_truncated(path: Path) -> None:
    tensors, metadata = load_safetensors_checked(path)
    atomic_save_safetensors(tensors, path, {**metadata, "state": metadata["state"][:-7]})


def _state_without(*keys: str) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        tensors, metadata = load_safetensors_checked(path)
        state = json.loads(metadata["state"])
        *parents, last = keys
        inner = state
        for key in parents:
            inner = inner[key]
        del inner[last]
        atomic_save_safetensors(tensors, path, {**metadata, "state": json.dumps(state)})
    return damage


@pytest.mark.parametrize("damage", [
    pytest.param(lambda path: _change_metadata_digit(path, b'steps_done\\": '), id="steps-done-digit"),
    pytest.param(_flip_payload_byte, id="tensor-payload"),
    # Checksums that match but a state that cannot be restored (a writer's bug, or a file from before the
    # checksum covered the metadata): resume still falls back instead of crashing.
    pytest.param(_state_json_truncated, id="state-json-truncated"),
    pytest.param(_state_without("optimizer"), id="state-key-missing"),
    # Found only after the weights were already copied in: the fallback must overwrite them.
    pytest.param(_state_without("optimizer", "scalars"), id="optimizer-key-missing"),
])
def test_resume_falls_back_past_a_damaged_newest_checkpoint(damage, tmp_path, caplog):
    newest = _rotating_pair(tmp_path)
    damage(newest)
    learner = _learner(2)
    assert learner.resume(tmp_path).name == "step-00000001.safetensors"
    assert learner.steps_done == 1
    reference = _learner(0)
    assert all(torch.equal(learner.params[name], reference.params[name]) for name in reference.params)
    warning = caplog.text
    assert "skipping" in warning and str(newest) in warning and "trying the previous checkpoint" in warning


def test_a_state_that_cannot_be_restored_is_a_corrupt_checkpoint(tmp_path):
    path = tmp_path / "learner.safetensors"
    _learner(0).save(path)
    _state_json_truncated(path)
    with pytest.raises(CorruptCheckpointError, match="not valid JSON"):
        _learner(0).load(path)


def test_files_from_before_the_metadata_checksum_still_load(tmp_path):
    """The previous format (LEGACY_CHECKSUM_KEY: tensors only) is recognised by its key and read, so
    existing checkpoints and adapters keep working; its tensors are still verified."""
    from safetensors.torch import save_file

    tensors = {"a": torch.arange(6, dtype=torch.float64), "b": torch.ones(2, 3)}
    path = tmp_path / "legacy.safetensors"
    save_file(tensors, str(path), metadata={"note": "x", LEGACY_CHECKSUM_KEY: tensors_sha256(tensors)})
    loaded, metadata = load_safetensors_checked(path)
    assert metadata["note"] == "x" and all(torch.equal(loaded[k], v) for k, v in tensors.items())
    _flip_payload_byte(path)
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        load_safetensors_checked(path)
