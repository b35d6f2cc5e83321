"""A full disk, where edgetrain writes: a named DiskFullError (an EdgetrainError and an OSError) that says which
path, what it needed when known and what is free; the temp removed; nothing already on disk changed; a run
that resumes after space is freed ends bit for bit where an uninterrupted run does.

Two ways to fill a disk, both in the default lane: a real tmpfs of a few hundred KiB where the tests may
mount one (root, as in CI), and ENOSPC injected at the write (os.fsync raising it, as NFS and some flash file
systems report a full disk) where they may not."""
from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import pytest

import fault_tally
from edgetrain.cli import main
from edgetrain.files.atomic import atomic_write_bytes, atomic_write_directory, atomic_write_file
from edgetrain.files.space import DiskFullError, free_bytes

CORPUS = "the device learns where it runs, and keeps what it learned. " * 200
TRAIN = ["train", "--model", "tiny", "--method", "mesp", "--steps", "4", "--seq", "32", "--batch", "2",
         "--checkpoint-every", "1", "--threads", "1", "--quiet"]


@pytest.fixture
def small_disk(tmp_path):
    """mount(size_kib) -> a directory on a fresh tmpfs of that size; resize(size_kib) grows it (space freed)."""
    mounted: list[Path] = []

    def mount(size_kib: int) -> Path:
        point = tmp_path / f"disk{len(mounted)}"
        point.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(point)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (not root?): {done.stderr.strip()}")
        mounted.append(point)
        return point

    def resize(point: Path, size_kib: int) -> None:
        subprocess.run(["mount", "-o", f"remount,size={size_kib}k", str(point)], check=True)

    mount.resize = resize
    yield mount
    for point in mounted:
        # Lazily: a file a failed test left open must not keep the mount (and tmp_path's cleanup) busy.
        subprocess.run(["umount", "-l", str(point)], capture_output=True)


def _enospc(*_args, **_kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def fill_up(directory: Path, leave: int = 64 * 1024) -> Path:
    """Another app's file that takes all but `leave` bytes of the disk holding `directory`."""
    filler = directory / "another-app.bin"
    filler.write_bytes(b"\0" * max(0, free_bytes(directory) - leave))
    return filler


def cli_refuses(argv: list[str], capsys, *says: str) -> str:
    """Run `edgetrain ARGV`, which must end in exit status 2 with one sentence on stderr saying `says` (no
    traceback); counted as a refusal of the full-disk class. What it said."""
    code = main(argv)
    said = capsys.readouterr().err
    lines = [line for line in said.splitlines() if "error:" in line]
    sound = (code == 2 and len(lines) == 1 and "Traceback" not in said
             and all(part in lines[0] for part in ("no space left on the device", *says)))
    fault_tally.record("full disk", "refused" if sound else "silently wrong")
    assert sound, f"exit {code}: {said}"
    return lines[0]


def test_a_write_that_runs_out_of_space_is_named_and_leaves_the_old_file(tmp_path, monkeypatch):
    target = tmp_path / "state.bin"
    atomic_write_bytes(b"old contents", target)
    monkeypatch.setattr(os, "fsync", _enospc)
    error = fault_tally.refused("full disk", lambda: atomic_write_file(target, lambda tmp: tmp.write_bytes(b"new")),
                                match=f"no space left on the device to write {target}: it did not fit")
    assert isinstance(error, DiskFullError) and "nothing already there was changed" in str(error)
    assert target.read_bytes() == b"old contents"
    assert [p.name for p in tmp_path.iterdir()] == ["state.bin"]  # the temp is gone
    error = fault_tally.refused("full disk", lambda: atomic_write_bytes(b"new", target))
    assert isinstance(error, OSError) and error.errno == errno.ENOSPC  # an OSError too, with the file system's errno


def test_a_directory_write_that_runs_out_of_space_keeps_the_old_directory(tmp_path, monkeypatch):
    target = tmp_path / "adapter"
    atomic_write_directory(target, lambda tmp: (tmp / "weights").write_bytes(b"old"))
    monkeypatch.setattr(os, "fsync", _enospc)
    fault_tally.refused("full disk",
                        lambda: atomic_write_directory(target, lambda tmp: (tmp / "weights").write_bytes(b"new")),
                        match=f"directory {target}: it did not fit")
    assert (target / "weights").read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]


def test_a_write_whose_size_is_known_is_refused_before_anything_is_written(small_disk):
    disk = small_disk(64)
    fault_tally.refused("full disk", lambda: atomic_write_bytes(b"x" * 200_000, disk / "big.bin"),
                        match="big.bin: it needs 200,000 bytes, 65,536 bytes free")
    assert list(disk.iterdir()) == []
    fault_tally.refused("full disk", lambda: atomic_write_directory(disk / "adapter", lambda tmp: None, needed=200_000),
                        match="directory " + str(disk / "adapter") + ": it needs 200,000 bytes")
    assert list(disk.iterdir()) == []


def _weights(checkpoint: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(checkpoint))


def test_a_run_whose_checkpoints_cannot_fit_is_refused_before_its_first_checkpoint(small_disk, tmp_path, capsys):
    """The rotation keeps two checkpoints and writes a third before the oldest goes: 1.4 MB holds one 0.9 MB
    checkpoint, not three, so the run is refused with the sizes once its first step has made the optimizer's
    state (before it, the adapter alone fits), not after the steps of a first checkpoint."""
    notes = tmp_path / "notes.txt"
    notes.write_text(CORPUS)
    run = small_disk(1400) / "checkpoints"
    cli_refuses([*TRAIN, "--files", str(notes), "--checkpoint-dir", str(run)], capsys,
                "the rotating checkpoints (3 at most at once", "step-00000001.safetensors")
    assert list(run.iterdir()) == []  # nothing written


def test_a_disk_that_fills_during_a_run_stops_it_with_a_sentence_and_it_resumes_bit_for_bit(small_disk, tmp_path):
    """Another app fills the disk after the first checkpoint (a real tmpfs); the second save is refused by name,
    the first checkpoint stays, and once space is freed the run resumes to the weights of a run never stopped."""
    import torch

    import edgetrain
    from edgetrain.data import make_stream
    from edgetrain.files.space import DiskFullError, free_bytes

    def learner():
        torch.manual_seed(0)
        model = edgetrain.load_model("tiny")
        edgetrain.add_lora(model, rank=4)
        return edgetrain.Learner(model, method="mesp", optimizer="adamw", lr=1e-2, probe=False, threads=1)

    def stream(start: int = 0):
        return make_stream("text", batch_size=2, seq_len=32, vocab_size=256, start_index=start)

    reference = tmp_path / "reference"
    learner().fit(stream(), max_steps=4, checkpoint_every=1, checkpoint_dir=reference)
    run = small_disk(8 * 1024) / "checkpoints"
    filler = run.parent / "another-app.bin"

    def fill_the_disk(_learner, stats):  # called after a step, before its checkpoint
        if stats.step == 2:
            filler.write_bytes(b"\0" * (free_bytes(run) - 64 * 1024))

    interrupted = learner()
    fault_tally.refused("full disk", lambda: interrupted.fit(stream(), max_steps=4, checkpoint_every=1,
                                                             checkpoint_dir=run, callbacks=[fill_the_disk]),
                        match="step-00000002.safetensors: it needs")
    with fault_tally.checked("full disk"):
        assert sorted(p.name for p in run.iterdir()) == ["step-00000001.safetensors"]  # kept, no temp left
        filler.unlink()  # space freed
        resumed = learner()
        resumed.resume(run)
        resumed.fit(stream(resumed.stream_position), max_steps=4, checkpoint_every=1, checkpoint_dir=run)
        ours, theirs = _weights(run / "step-00000004.safetensors"), _weights(reference / "step-00000004.safetensors")
        assert set(ours) == set(theirs) and all(ours[name].equal(theirs[name]) for name in theirs)


def test_train_on_a_filling_disk_stops_with_a_sentence_and_resumes_bit_for_bit(tmp_path, monkeypatch, capsys):
    notes = tmp_path / "notes.txt"
    notes.write_text(CORPUS)
    reference = tmp_path / "reference"
    assert main([*TRAIN, "--files", str(notes), "--checkpoint-dir", str(reference)]) == 0
    import edgetrain.files.atomic as atomic

    run = tmp_path / "checkpoints"
    saves = []
    real_write = atomic._atomic_write_file

    def second_save_fails(path, fill, needed):  # ENOSPC at the write, as NFS and some flash file systems say it
        saves.append(path)
        if len(saves) == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(path, fill, needed)

    monkeypatch.setattr(atomic, "_atomic_write_file", second_save_fails)
    capsys.readouterr()
    cli_refuses([*TRAIN, "--files", str(notes), "--checkpoint-dir", str(run)], capsys, "step-00000002.safetensors")
    with fault_tally.checked("full disk"):
        assert sorted(p.name for p in run.iterdir()) == ["step-00000001.safetensors"]  # kept, no temp left
        monkeypatch.undo()
        assert main([*TRAIN, "--files", str(notes), "--checkpoint-dir", str(run)]) == 0
        resumed = _weights(run / "step-00000004.safetensors")
        uninterrupted = _weights(reference / "step-00000004.safetensors")
        assert set(resumed) == set(uninterrupted)
        assert all(resumed[name].equal(uninterrupted[name]) for name in uninterrupted)


def test_personalise_add_on_a_full_disk_keeps_the_stored_examples(small_disk, tmp_path, capsys):
    from edgetrain.personalise.errors import StoreFullError
    from edgetrain.personalise.store import Store

    disk = small_disk(200)
    notes = []
    for index in range(40):
        notes.append(tmp_path / f"note{index}.txt")
        notes[-1].write_text(f"Note {index}. " + CORPUS[:8000])
    store = disk / "store"
    assert main(["personalise", "add", "--store", str(store), "--quiet", *map(str, notes[:2])]) == 0
    capsys.readouterr()
    # The examples' text alone is more than the disk has: refused before SQLite writes any of it.
    cli_refuses(["personalise", "add", "--store", str(store), "--quiet", *map(str, notes)], capsys,
                "for the store", "it needs 321,350 bytes")
    assert Store(store).count()[0] == 2
    # Text that fits but whose pages do not: SQLite's own "database or disk is full", named the same way.
    fill_up(disk, leave=12 * 1024)
    cli_refuses(["personalise", "add", "--store", str(store), "--quiet", *map(str, notes[2:3])], capsys,
                "for the store", "SQLite said: database or disk is full")
    (disk / "another-app.bin").unlink()
    small_disk.resize(disk, 5 * 1024)
    with Store(store) as examples:
        assert examples.count()[0] == 2
    assert main(["personalise", "add", "--store", str(store), "--quiet", *map(str, notes[2:5])]) == 0
    assert Store(store).count()[0] == 5
    assert issubclass(StoreFullError, DiskFullError)


def test_a_directory_that_a_full_disk_cannot_create_is_named(tmp_path, monkeypatch):
    """ENOSPC injected at mkdir (a new directory takes a block on ext4 and f2fs): the store, a version's or a
    window's directory (edgetrain.files.atomic.make_directory), an output's parent."""
    from edgetrain.files.atomic import make_directory
    from edgetrain.personalise.errors import StoreFullError
    from edgetrain.personalise.store import Store

    monkeypatch.setattr(Path, "mkdir", _enospc)
    error = fault_tally.refused("full disk", lambda: Store(tmp_path / "store"),
                                match=f"cannot create the store {tmp_path / 'store'}: no space left on the device")
    assert isinstance(error, StoreFullError)
    fault_tally.refused("full disk", lambda: make_directory(tmp_path / "versions" / "v000002", "the version directory"),
                        match=f"the version directory {tmp_path / 'versions' / 'v000002'}: it did not fit")
    fault_tally.refused("full disk", lambda: atomic_write_bytes(b"x", tmp_path / "new" / "file.bin"),
                        match=f"directory {tmp_path / 'new'}: it did not fit")


def test_a_full_disk_that_a_library_reports_itself_still_ends_in_a_sentence(tmp_path, monkeypatch, capsys):
    """The CLI's net under every command: an ENOSPC OSError that no edgetrain writer named (a library writing a
    file of its own) is said as a full disk, exit 2, not a traceback."""
    import edgetrain.cli.export_adapter as command

    target = tmp_path / "out.gguf"

    def a_library_writes(_args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(target))

    monkeypatch.setattr(command, "main", a_library_writes)
    cli_refuses(["export-adapter", "--adapter", "a", "--format", "gguf", "--out", str(target)], capsys,
                f"{target}: it did not fit", "free in")


def test_exports_to_a_full_disk_are_refused_early_or_named_part_way_and_leave_nothing(small_disk, tmp_path):
    """A merged GGUF: refused before writing where the disk cannot hold its tensors; where it can hold them but
    not the whole file (metadata, alignment), its writer runs out part-way."""
    import edgetrain
    from edgetrain.export.merged import save_merged_gguf
    from gguf_testkit import hf_model, write_gguf

    base = write_gguf(tmp_path / "base.gguf", hf_model())
    model = edgetrain.load_model(base)
    disk = small_disk(64)
    fault_tally.refused("full disk", lambda: save_merged_gguf(model, base, disk / "merged.gguf", dtype="f32"),
                        match=f"{disk / 'merged.gguf'}: it needs 450,304 bytes, 65,536 bytes free")
    assert list(disk.iterdir()) == []
    # 440 KiB: the tensors' 450,304 bytes fit, the 457,184 of the file do not.
    disk = small_disk(440)
    fault_tally.refused("full disk", lambda: save_merged_gguf(model, base, disk / "merged.gguf", dtype="f32"),
                        match=f"{disk / 'merged.gguf'}: it did not fit (it needs at least 450,304 bytes)")
    assert list(disk.iterdir()) == []
    # The writer's file was closed too: the temp's space is free again, not held by an open descriptor.
    assert os.statvfs(disk).f_bfree == os.statvfs(disk).f_blocks


# -- the personaliser ------------------------------------------------------------------------------------

NOTES = [f"Note {index}: {CORPUS[index * 37:index * 37 + 200]}" for index in range(40)]


def _personaliser(store: Path, on_event=None):
    from edgetrain.personalise import Personaliser, Policy

    # Small and quick as tests/personalise's FAST, on one thread: a resumed window is then bit for bit.
    return Personaliser(store, "tiny", lr=5e-3, batch_size=4, seq_len=32, window_steps=6, checkpoint_every=2,
                        holdout_every=4, policy=Policy(check_every_s=0), poll_seconds=0.05, retain_margin=None,
                        threads=1, on_event=on_event)


@pytest.fixture(scope="module")
def personalised_reference(tmp_path_factory):
    """Two windows run without a stop: versions 1 and 2 promoted."""
    store = tmp_path_factory.mktemp("reference") / "store"
    with _personaliser(store) as personaliser:
        personaliser.add_many(NOTES)
        result = personaliser.run(max_steps=12)
    assert result.promoted == [1, 2], result
    return store


def _version(store: Path, number: int) -> dict:
    return _weights(store / "versions" / f"v{number:06d}" / "adapter.safetensors")


def _same_version(store: Path, reference: Path, number: int) -> bool:
    ours, theirs = _version(store, number), _version(reference, number)
    return set(ours) == set(theirs) and all(ours[name].equal(theirs[name]) for name in theirs)


def _promoted_version_intact(store: Path) -> None:
    """The store after a run stopped by a full disk in its second window: every example, version 1 promoted,
    served (its checksum verified) and loadable, and no second version's directory left."""
    with _personaliser(store) as personaliser:
        assert personaliser.store.count()[0] == len(NOTES)
        assert personaliser.versions.promoted() == 1 and personaliser.served_version().version == 1
        personaliser.model_for_inference()
    assert sorted(p.name for p in (store / "versions").iterdir()) == ["v000001"]


@pytest.mark.parametrize("when, says", [
    (("step", 3), "window/checkpoints/step-00000004.safetensors: it needs"),  # the window's checkpoint
    (("evaluated", None), "window/candidate/adapter.safetensors: it needs"),  # the new version's adapter
])
def test_personalise_run_on_a_filling_disk_keeps_the_promoted_version_and_resumes_bit_for_bit(
        small_disk, personalised_reference, when, says):
    """Another app fills the disk (a real tmpfs) in the second window: at a step (its next checkpoint is refused)
    or at the gate (the promoted candidate's adapter is refused). The run stops with the file named, version 1
    stays promoted, and once space is freed the next run promotes the version 2 an uninterrupted run did."""
    disk = small_disk(8 * 1024)
    store = disk / "store"
    kind, step = when
    filled: list[Path] = []

    def fill_in_window_two(event):
        if (event["event"] == kind and event.get("window") == 2 and event.get("step", step) == step
                and not filled):
            filled.append(fill_up(disk))

    personaliser = _personaliser(store, on_event=fill_in_window_two)
    personaliser.add_many(NOTES)
    fault_tally.refused("full disk", lambda: personaliser.run(max_steps=12), match=says)
    personaliser.close()
    with fault_tally.checked("full disk"):
        _promoted_version_intact(store)
        filled[0].unlink()  # space freed
        with _personaliser(store) as personaliser:
            assert 2 in personaliser.run(max_steps=6).promoted
        assert _same_version(store, personalised_reference, 2)


def test_personalise_status_plot_on_a_full_disk_keeps_the_previous_picture(small_disk, personalised_reference, capsys):
    pytest.importorskip("matplotlib", reason="the plot extra")
    disk = small_disk(64)
    picture = disk / "history.png"
    picture.write_bytes(b"the previous picture")
    fill_up(disk, leave=0)
    cli_refuses(["personalise", "status", "--store", str(personalised_reference), "--plot", str(picture)], capsys,
                f"{picture}: it needs")
    assert picture.read_bytes() == b"the previous picture"
    assert sorted(p.name for p in disk.iterdir()) == ["another-app.bin", "history.png"]


class _FullAt:
    """A store connection whose statements starting with `prefix` fail as SQLite fails on a full disk."""

    def __init__(self, connection, prefix: str) -> None:
        self.connection, self.prefix = connection, prefix

    def execute(self, statement: str, *arguments):
        import sqlite3

        if statement.lstrip().startswith(self.prefix):
            raise sqlite3.OperationalError("database or disk is full")
        return self.connection.execute(statement, *arguments)

    def __getattr__(self, name: str):
        return getattr(self.connection, name)


def test_a_promotion_the_store_cannot_record_keeps_the_promoted_version(tmp_path, monkeypatch, personalised_reference):
    """SQLite says the disk is full when the second version is recorded (injected at its INSERT): the transaction
    is rolled back, the new version's directory removed at once, version 1 stays promoted, and the next run
    promotes the same version 2 as an uninterrupted run."""
    from contextlib import contextmanager

    from edgetrain.personalise.store import Store

    store = tmp_path / "store"
    real = Store.transaction

    @contextmanager
    def full_at_the_second_version(self):
        with real(self) as connection:
            recorded = connection.execute("SELECT COUNT(*) FROM versions").fetchone()[0]
            yield _FullAt(connection, "INSERT INTO versions") if recorded == 1 else connection

    monkeypatch.setattr(Store, "transaction", full_at_the_second_version)
    personaliser = _personaliser(store)
    personaliser.add_many(NOTES)
    fault_tally.refused("full disk", lambda: personaliser.run(max_steps=12),
                        match="examples.sqlite: no space left on the device for the store")
    personaliser.close()
    monkeypatch.undo()
    with fault_tally.checked("full disk"):
        _promoted_version_intact(store)
        with _personaliser(store) as personaliser:
            assert personaliser.run(max_steps=6).promoted[0] == 2
        assert _same_version(store, personalised_reference, 2)


def test_the_event_log_on_a_full_disk_is_named_and_keeps_whole_lines(tmp_path, small_disk, monkeypatch):
    from edgetrain.personalise.events import EventLog, read_events

    log = EventLog(tmp_path / "events.jsonl")
    log.emit("first")
    real_write = os.write

    def half_a_line(descriptor, data):  # a short write, as a disk that fills mid-line gives
        return real_write(descriptor, data[:len(data) // 2])

    for write in (half_a_line, _enospc):
        monkeypatch.setattr(os, "write", write)
        fault_tally.refused("full disk", lambda: log.emit("second", text="x" * 1000),
                            match=f"the event log {tmp_path / 'events.jsonl'}")
        monkeypatch.undo()
        assert [event["event"] for event in read_events(log.path)] == ["first"]
        assert log.path.read_bytes().endswith(b"}\n")  # no torn line for the next one to run into
    disk = small_disk(64)  # and for real: a line that needs a page the disk no longer has
    log = EventLog(disk / "events.jsonl")
    log.emit("first")
    fill_up(disk, leave=0)
    fault_tally.refused("full disk", lambda: log.emit("second", text="x" * 8192), match="the event log")
    assert [event["event"] for event in read_events(log.path)] == ["first"]


def test_personalise_run_through_the_cli_on_a_full_disk_says_so_and_goes_on_once_there_is_room(small_disk, tmp_path,
                                                                                               capsys):
    """1.6 MB hold the store, its base adapter and the window's examples, not the window's rotating checkpoints
    (0.9 MB each)."""
    disk = small_disk(1600)
    store = disk / "store"
    notes = tmp_path / "notes.jsonl"
    import json

    notes.write_text("".join(json.dumps({"text": note}) + "\n" for note in NOTES))
    assert main(["personalise", "add", "--store", str(store), "--quiet", str(notes)]) == 0
    run = ["personalise", "run", "--store", str(store), "--model", "tiny", "--max-steps", "6", "--seq", "32",
           "--window-steps", "6", "--checkpoint-every", "2", "--lr", "5e-3", "--holdout-every", "4", "--no-guard",
           "--threads", "1", "--quiet"]
    capsys.readouterr()
    # Refused after the window's first step, when a checkpoint's size is known: not at the first checkpoint due.
    # The stop's own checkpoint (one fits) keeps that step for the next run.
    cli_refuses(run, capsys, "the rotating checkpoints (3 at most at once",
                str(store / "window" / "checkpoints" / "step-00000002.safetensors"), "free in")
    assert [p.name for p in (store / "window" / "checkpoints").iterdir()] == ["step-00000001.safetensors"]
    small_disk.resize(disk, 8 * 1024)
    with fault_tally.checked("full disk"):
        assert main(run) == 0
        summary = json.loads(capsys.readouterr().out)
        assert summary["promoted"] == [1] and summary["served"] == 1
