"""Issue 40: temp files of killed writes do not accumulate.

A write killed by SIGKILL leaves its temp file (.NAME.PID.8HEX.tmp, or .tmpdir for a directory); the next
write into that directory removes it, whatever NAME it was for (checkpoint names change with their step)
and also when the killed writer's pid is still a zombie, is this process's own (a restarted container or
app gets the same pids again) or was taken again by a process started after the temp was written. Nothing
else is removed: not a temp whose writer is alive (another process, or another thread of this one), and
never a file of the user's that only looks like a temp.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from edgetrain.files.atomic import atomic_write_bytes, atomic_write_directory, atomic_write_file
from edgetrain.training.checkpoint import rotating_checkpoint_paths, save_rotating
from fault_tally import attempt, checked

KILLS, PATHS = "kills and crashes", "resources and paths"
LINUX = sys.platform.startswith("linux")

# A child that trains a tiny learner with a checkpoint after every step; with HANG_AT = n it stops inside
# its n-th checkpoint write, after the temp is complete and before the rename, says so, and waits to be killed.
CHILD = textwrap.dedent("""
    import os, sys, time
    import edgetrain
    from edgetrain.data import make_stream

    directory, hang_at, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    writes = [0]
    real_fsync = os.fsync

    def fsync(fd):
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".tmp"):
            writes[0] += 1
            if writes[0] == hang_at:
                open(os.path.join(directory, "..", "hanging"), "w").close()
                time.sleep(600)
        return real_fsync(fd)

    os.fsync = fsync
    model = edgetrain.add_lora(edgetrain.load_model("tiny"), rank=2)
    learner = edgetrain.Learner(model, method="mezo", optimizer="sgd", lr=1e-3, probe=False, seed=3)
    learner.resume(directory)
    stream = make_stream("text", batch_size=2, seq_len=16, vocab_size=256, seed=1,
                         start_index=learner.stream_position)
    learner.fit(stream, max_steps=steps, checkpoint_every=1, checkpoint_dir=directory, progress=False)
""")


def _temps(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith((".tmp", ".tmpdir")))


def _child(directory: Path, hang_at: int, steps: int) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-c", CHILD, str(directory), str(hang_at), str(steps)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)


def _kill_when_hanging(process: subprocess.Popen, marker: Path, reap: bool = True) -> None:
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert process.poll() is None, process.communicate()[1].decode()[-2000:]
        assert time.monotonic() < deadline, "the child never reached its checkpoint write"
        time.sleep(0.02)
    marker.unlink()
    process.send_signal(signal.SIGKILL)
    if reap:
        process.wait()


def _dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen(["sleep", "60"])


@pytest.mark.skipif(not LINUX, reason="the child finds its temp's fsync through /proc/self/fd")
def test_temps_of_checkpoint_writes_killed_at_different_steps_are_removed_by_the_rerun(tmp_path):
    directory = tmp_path / "ckpt"
    directory.mkdir()
    left = []
    with checked(KILLS):
        for hang_at in (2, 2, 3):  # each run resumes, so its 2nd write is at another step than the last run's
            process = _child(directory, hang_at, steps=8)
            _kill_when_hanging(process, tmp_path / "hanging")
            assert process.returncode == -signal.SIGKILL
            left.append(set(_temps(directory)) - set().union(*[set(x) for x in left]))
        assert len(set().union(*left)) == 3, left  # one temp per kill, each of another name: they piled up
        rerun = _child(directory, 0, steps=8)
        _, err = rerun.communicate(timeout=300)
        assert rerun.returncode == 0, err.decode()[-2000:]
        assert _temps(directory) == []
        assert [p.name for p in rotating_checkpoint_paths(directory)] == ["step-00000008.safetensors",
                                                                          "step-00000007.safetensors"]


@pytest.mark.skipif(not LINUX, reason="a zombie is told by /proc")
def test_the_temp_of_a_killed_writer_not_yet_reaped_is_removed(tmp_path):
    """The parent that killed the writer saves before reaping it: the writer is a zombie, which writes
    nothing more."""
    directory = tmp_path / "ckpt"
    directory.mkdir()
    process = _child(directory, 2, steps=4)
    _kill_when_hanging(process, tmp_path / "hanging", reap=False)
    try:
        deadline = time.monotonic() + 30
        while Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        stale = _temps(directory)
        assert len(stale) == 1 and f".{process.pid}." in stale[0]
        with checked(KILLS):
            save_rotating({"w": torch.zeros(3)}, {}, directory, 9)
            assert _temps(directory) == []
    finally:
        process.wait()


def _fake_temp(directory: Path, name: str, pid: int, suffix: str = ".tmp", age: float = 0.0) -> Path:
    path = directory / f".{name}.{pid}.0123abcd{suffix}"
    if suffix == ".tmpdir":
        path.mkdir()
        (path / "adapter_config.json").write_text("{}")
    else:
        path.write_bytes(b"half a checkpoint")
    if age:
        then = time.time() - age
        os.utime(path, (then, then))
    return path


@pytest.mark.parametrize("writer", ["file", "rotating", "directory"])
def test_every_writer_removes_every_dead_writers_temps_in_its_directory(writer, tmp_path):
    dead = _dead_pid()
    stale = [_fake_temp(tmp_path, "step-00000004.safetensors", dead),
             _fake_temp(tmp_path, "adapter.safetensors", dead),
             _fake_temp(tmp_path, "profile.json", dead),
             _fake_temp(tmp_path, "..write-test", dead),
             _fake_temp(tmp_path, "name.with.dots.gguf", dead),
             _fake_temp(tmp_path, "adapter-mlx", dead, ".tmpdir"),
             _fake_temp(tmp_path, "ünïcode naam.bin", dead)]
    write = {"file": lambda: atomic_write_bytes(b"new", tmp_path / "out.bin"),
             "rotating": lambda: save_rotating({"w": torch.ones(2)}, {}, tmp_path, 5),
             "directory": lambda: atomic_write_directory(tmp_path / "adapter-dir",
                                                         lambda d: (d / "a.json").write_text("{}"))}[writer]
    attempt(KILLS, write, sound=lambda _: not any(os.path.lexists(p) for p in stale))


def test_a_temp_named_with_this_processs_own_pid_that_it_is_not_writing_is_removed(tmp_path):
    """A restarted container or app gets the same pids: the killed writer's pid is the rerun's own."""
    leftover = _fake_temp(tmp_path, "step-00000003.safetensors", os.getpid())
    leftover_dir = _fake_temp(tmp_path, "adapters", os.getpid(), ".tmpdir")
    attempt(KILLS, lambda: save_rotating({"w": torch.ones(2)}, {}, tmp_path, 4),
            sound=lambda _: not leftover.exists() and not leftover_dir.exists())


@pytest.mark.skipif(not LINUX, reason="a process's start time is read from /proc")
def test_a_temp_whose_pid_was_taken_by_a_later_process_is_removed(tmp_path):
    sleeper = _sleeper()
    try:
        reused = _fake_temp(tmp_path, "step-00000003.safetensors", sleeper.pid, age=3600)  # written an hour ago
        attempt(KILLS, lambda: save_rotating({"w": torch.ones(2)}, {}, tmp_path, 4),
                sound=lambda _: not reused.exists())
    finally:
        sleeper.kill()
        sleeper.wait()


def test_temps_of_live_writers_are_kept(tmp_path):
    """Another process's temp, written after it started, and a temp another thread of this process is
    filling right now, both in the directory being written."""
    sleeper = _sleeper()
    try:
        time.sleep(0.05)
        other = _fake_temp(tmp_path, "step-00000003.safetensors", sleeper.pid)
        filling, release = threading.Event(), threading.Event()
        result: dict[str, object] = {}

        def slow_fill(tmp: Path) -> None:
            tmp.write_bytes(b"first half")
            filling.set()
            release.wait(30)
            with open(tmp, "ab") as handle:
                handle.write(b", second half")

        thread = threading.Thread(target=lambda: result.setdefault(
            "path", atomic_write_file(tmp_path / "big.bin", slow_fill)))
        thread.start()
        assert filling.wait(30)
        mine = [name for name in _temps(tmp_path) if name.startswith(".big.bin.")]

        def sound(_: object) -> bool:
            return other.exists() and len(mine) == 1 and (tmp_path / mine[0]).exists()

        attempt(PATHS, lambda: save_rotating({"w": torch.ones(2)}, {}, tmp_path, 4), sound=sound)
        release.set()
        thread.join(30)
        assert result.get("path") == tmp_path / "big.bin"
        assert (tmp_path / "big.bin").read_bytes() == b"first half, second half"
    finally:
        sleeper.kill()
        sleeper.wait()


def _look_alikes(directory: Path, dead: int) -> dict[str, Path]:
    """Files of the user's whose names come close to edgetrain's temps but are not one (or, the last
    ones, have the name but are not the kind of entry edgetrain writes there)."""
    names = [f"notes.{dead}.0123abcd.tmp",            # no leading dot
             f".notes.{dead}.0123ABCD.tmp",           # upper-case hex
             f".notes.{dead}.0123abc.tmp",            # 7 hex digits
             f".notes.{dead}.0123abcde.tmp",          # 9 hex digits
             f".notes.{dead}.0123abcg.tmp",           # not hex
             f".notes.{dead}.0123abcd.tmp.bak",       # something after the suffix
             f".notes.{dead}.0123abcd.temp",          # another suffix
             f".notes.{dead}.0123abcd.TMP",
             f".notes.{dead}.0123abcd",               # no suffix
             f".notes.x{dead}.0123abcd.tmp",          # pid not all digits
             f".notes.-{dead}.0123abcd.tmp",
             f"..{dead}.0123abcd.tmp",                # no name
             f".notes.{dead}0123abcd.tmp",            # a dot missing
             ".notes.tmp", ".tmp", ".tmpdir", "x.tmp", f".{dead}.0123abcd.tmp",
             ".notes.old", ".adapter-dir.old.keep"]
    paths = {}
    for name in names:
        path = directory / name
        path.write_text(f"the user's {name}")
        paths[name] = path
    # The right name, the wrong kind: a .tmpdir that is a file, a .tmp that is a directory, symlinks.
    as_file = directory / f".photos.{dead}.0123abcd.tmpdir"
    as_file.write_text("the user's file")
    as_dir = directory / f".photos.{dead}.0123abcd.tmp"
    as_dir.mkdir()
    (as_dir / "holiday.jpg").write_text("the user's photo")
    precious = directory / "precious.txt"
    precious.write_text("the user's precious file")
    link = directory / f".precious.txt.{dead}.0123abcd.tmp"
    link.symlink_to(precious)
    link_dir = directory / f".album.{dead}.0123abcd.tmpdir"
    link_dir.symlink_to(as_dir, target_is_directory=True)
    nested = directory / "sub"
    nested.mkdir()
    inside = nested / f".notes.{dead}.0123abcd.tmp"  # a temp-like name in another directory
    inside.write_text("the user's nested file")
    paths.update({p.name: p for p in (as_file, as_dir, precious, link, link_dir, inside)})
    return paths


@pytest.mark.parametrize("writer", ["file", "rotating", "directory"])
def test_files_of_the_users_that_look_like_temps_are_never_removed(writer, tmp_path):
    dead = _dead_pid()
    user = _look_alikes(tmp_path, dead)
    before = {name: (path.is_symlink(), path.is_dir(), None if path.is_dir() else path.read_bytes())
              for name, path in user.items()}
    stale = _fake_temp(tmp_path, "step-00000001.safetensors", dead)  # a real leftover beside them
    write = {"file": lambda: atomic_write_bytes(b"new", tmp_path / "out.bin"),
             "rotating": lambda: save_rotating({"w": torch.ones(2)}, {}, tmp_path, 5),
             "directory": lambda: atomic_write_directory(tmp_path / "adapter-dir",
                                                         lambda d: (d / "a.json").write_text("{}"))}[writer]

    def untouched(_: object) -> bool:
        now = {name: (path.is_symlink(), path.is_dir(), None if path.is_dir() else path.read_bytes())
               for name, path in user.items() if os.path.lexists(path)}
        return now == before and not stale.exists() and \
            (tmp_path / f".photos.{dead}.0123abcd.tmp" / "holiday.jpg").exists()

    attempt(PATHS, write, sound=untouched)
