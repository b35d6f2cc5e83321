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

from edgetrain.cli import main
from edgetrain.files.atomic import atomic_write_bytes, atomic_write_directory, atomic_write_file
from edgetrain.files.space import DiskFullError

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


def test_a_write_that_runs_out_of_space_is_named_and_leaves_the_old_file(tmp_path, monkeypatch):
    target = tmp_path / "state.bin"
    atomic_write_bytes(b"old contents", target)
    monkeypatch.setattr(os, "fsync", _enospc)
    with pytest.raises(DiskFullError, match=rf"no space left on the device to write {target}.*nothing already"):
        atomic_write_file(target, lambda tmp: tmp.write_bytes(b"new contents"))
    assert target.read_bytes() == b"old contents"
    assert [p.name for p in tmp_path.iterdir()] == ["state.bin"]  # the temp is gone
    with pytest.raises(OSError) as raised:  # an OSError too, with the file system's errno
        atomic_write_bytes(b"new", target)
    assert raised.value.errno == errno.ENOSPC


def test_a_directory_write_that_runs_out_of_space_keeps_the_old_directory(tmp_path, monkeypatch):
    target = tmp_path / "adapter"
    atomic_write_directory(target, lambda tmp: (tmp / "weights").write_bytes(b"old"))
    monkeypatch.setattr(os, "fsync", _enospc)
    with pytest.raises(DiskFullError, match="directory"):
        atomic_write_directory(target, lambda tmp: (tmp / "weights").write_bytes(b"new"))
    assert (target / "weights").read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]


def test_a_write_whose_size_is_known_is_refused_before_anything_is_written(small_disk):
    disk = small_disk(64)
    with pytest.raises(DiskFullError, match=r"it needs 200,000 bytes, [\d,]+ bytes free"):
        atomic_write_bytes(b"x" * 200_000, disk / "big.bin")
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
    assert main([*TRAIN, "--files", str(notes), "--checkpoint-dir", str(run)]) == 2
    said = capsys.readouterr().err
    assert "no space left on the device to write the rotating checkpoints (3 at most at once" in said
    assert "step-00000001.safetensors" in said and "Traceback" not in said
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
    with pytest.raises(DiskFullError, match="step-00000002.safetensors: it needs"):
        interrupted.fit(stream(), max_steps=4, checkpoint_every=1, checkpoint_dir=run, callbacks=[fill_the_disk])
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
    assert main([*TRAIN, "--files", str(notes), "--checkpoint-dir", str(run)]) == 2
    said = capsys.readouterr().err
    assert "no space left on the device to write" in said and "step-00000002.safetensors" in said
    assert "Traceback" not in said
    assert sorted(p.name for p in run.iterdir()) == ["step-00000001.safetensors"]  # kept, no temp left
    monkeypatch.undo()
    assert main([*TRAIN, "--files", str(notes), "--checkpoint-dir", str(run)]) == 0
    resumed, uninterrupted = _weights(run / "step-00000004.safetensors"), _weights(reference / "step-00000004.safetensors")
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
    assert main(["personalise", "add", "--store", str(store), "--quiet", *map(str, notes)]) == 2
    said = capsys.readouterr().err
    assert "no space left on the device for the store" in said and "Traceback" not in said
    small_disk.resize(disk, 5 * 1024)
    assert Store(store).count()[0] == 2
    assert issubclass(StoreFullError, DiskFullError)


def test_an_export_to_a_full_disk_is_named_and_leaves_nothing(small_disk, tmp_path):
    """A merged GGUF written to a disk too small for it (its writer does not know its size ahead: the write
    itself runs out)."""
    import edgetrain
    from edgetrain.export.merged import save_merged_gguf
    from gguf_testkit import hf_model, write_gguf

    base = write_gguf(tmp_path / "base.gguf", hf_model())
    model = edgetrain.load_model(base)
    disk = small_disk(64)
    with pytest.raises(DiskFullError, match=rf"no space left on the device to write {disk / 'merged.gguf'}: it did not"):
        save_merged_gguf(model, base, disk / "merged.gguf", dtype="f32")
    assert list(disk.iterdir()) == []
    # The writer's file was closed too: the temp's space is free again, not held by an open descriptor.
    assert os.statvfs(disk).f_bfree == os.statvfs(disk).f_blocks
