"""Linux probe: VmHWM / clear_refs / smaps_rollup, and the glibc mmap-threshold fix that makes
per-step peaks repeatable (checked in real subprocesses: mallopt changes the whole process)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from edgetrain.probes import LinuxProbe, ProbeUnavailableError, fix_malloc_mmap_threshold, malloc_threshold_env, measure
from edgetrain.probes.glibc import glibc_version

REPO = Path(__file__).resolve().parents[2]
MiB = 1024 * 1024

linux_only = pytest.mark.skipif(not LinuxProbe().available()[0],
                                reason=f"Linux probe unavailable here: {LinuxProbe().available()[1]}")
glibc_only = pytest.mark.skipif(glibc_version() is None, reason="mallopt(M_MMAP_THRESHOLD) needs glibc")


# Run in a fresh interpreter, as `edgetrain profile` runs its probes: after hundreds of tests in one
# process, RSS readings around a fresh block were seen to stay flat now and then (left-over threads
# of earlier tests); what is tested here is the probe, not that history.
FREED_BLOCK = """
from edgetrain.probes import LinuxProbe
from edgetrain.probes.base import settle_memory
MiB = 1 << 20
settle_memory()
probe = LinuxProbe()
probe.reset_peak()
before = probe.current_bytes()
block = b"\\x01" * (64 * MiB)  # written, so resident; above any mmap threshold, so unmapped on del
during = probe.current_bytes()
del block
after = probe.current_bytes()
peak = probe.peak_bytes()
assert during - before >= 60 * MiB, (before, during)
assert during - after >= 60 * MiB, (during, after)          # the block really left RSS ...
assert peak - after >= 60 * MiB, (peak, after)              # ... but the high-water mark kept it
probe.reset_peak()
assert probe.peak_bytes() - probe.current_bytes() < 8 * MiB
"""

MEASURED_BLOCK = """
from edgetrain.probes import LinuxProbe, measure
MiB = 1 << 20
peak = measure(LinuxProbe(), lambda: b"\\x01" * (48 * MiB))
assert 46 * MiB <= peak <= 60 * MiB, peak
"""


def _run_fresh(code: str) -> None:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-2000:]


@linux_only
def test_peak_sees_a_freed_block_and_reset_forgets_it():
    _run_fresh(FREED_BLOCK)


@linux_only
def test_measure_reports_the_block_above_baseline():
    _run_fresh(MEASURED_BLOCK)


def test_unavailable_without_proc_files_says_why(tmp_path):
    probe = LinuxProbe(proc_dir=tmp_path)
    ok, reason = probe.available()
    assert not ok and "status" in reason
    (tmp_path / "status").write_text("Name:\tpython\nVmRSS:\t  100 kB\n")
    ok, reason = probe.available()
    assert not ok and "VmHWM" in reason
    (tmp_path / "status").write_text("Name:\tpython\nVmHWM:\t  300 kB\nVmRSS:\t  100 kB\n")
    ok, reason = probe.available()
    assert not ok and "clear_refs" in reason


def test_reads_fields_from_a_proc_directory(tmp_path):
    (tmp_path / "status").write_text("VmHWM:\t  300 kB\nVmRSS:\t  100 kB\n")
    (tmp_path / "clear_refs").write_text("")
    (tmp_path / "smaps_rollup").write_text("00-ff ---p 00000000 00:00 0  [rollup]\nRss:   120 kB\nPss:  50 kB\n")
    probe = LinuxProbe(proc_dir=tmp_path)
    if sys.platform.startswith("linux"):
        assert probe.available() == (True, "")
    assert probe.current_bytes() == 120 * 1024     # smaps_rollup preferred over VmRSS
    assert probe.peak_bytes() == 300 * 1024
    probe.reset_peak()
    assert (tmp_path / "clear_refs").read_text() == "5"
    (tmp_path / "smaps_rollup").unlink()
    assert probe.current_bytes() == 100 * 1024     # falls back to VmRSS
    (tmp_path / "status").write_text("VmHWM:\t  50 kB\nVmRSS:\t  100 kB\n")
    assert probe.peak_bytes() == 100 * 1024        # never below current


def test_a_failed_reset_raises_with_the_reason(tmp_path):
    (tmp_path / "status").write_text("VmHWM:\t  300 kB\nVmRSS:\t  100 kB\n")
    (tmp_path / "clear_refs").mkdir()  # exists, but cannot be written to
    with pytest.raises(ProbeUnavailableError, match="cannot reset VmHWM"):
        LinuxProbe(proc_dir=tmp_path).reset_peak()


def test_threshold_helpers_validate():
    assert malloc_threshold_env() == {"MALLOC_MMAP_THRESHOLD_": "65536"}
    with pytest.raises(ValueError):
        malloc_threshold_env(64 * MiB)
    ok, reason = fix_malloc_mmap_threshold(64 * MiB)
    assert not ok and "range" in reason


# A small MLP step allocating ~40 MB, run 8 times; prints the per-step peak above baseline.
_CHILD = r"""
import json, os, sys
from edgetrain.probes import LinuxProbe, fix_malloc_mmap_threshold, measure
if sys.argv[1] == "mallopt":
    ok, why = fix_malloc_mmap_threshold()
    assert ok, why
import torch
from torch import nn
torch.manual_seed(0)
torch.set_num_threads(2)
model = nn.Sequential(nn.Linear(128, 2048), nn.GELU(), nn.Linear(2048, 10))
x, y = torch.randn(1536, 128), torch.randint(0, 10, (1536,))
def step():
    model.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(x), y).backward()
probe = LinuxProbe()
print(json.dumps([measure(probe, step) for _ in range(8)]))
"""


def _child_peaks(mode: str, extra_env: dict[str, str]) -> list[int]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.update(extra_env, PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-c", _CHILD, mode], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _assert_stable(peaks: list[int]) -> None:
    steady = peaks[2:]  # the first steps also pay one-off costs (thread pools, lazy init)
    assert min(steady) > 20 * MiB, peaks  # the step really allocates tens of MB
    spread = (max(steady) - min(steady)) / min(steady)
    assert spread < 0.03, [round(p / MiB, 1) for p in peaks]


@linux_only
@glibc_only
def test_mallopt_makes_identical_steps_report_identical_peaks():
    # With glibc's dynamic threshold these figures jump between ~0 and ~40 MB from step to step.
    _assert_stable(_child_peaks("mallopt", {}))


@linux_only
@glibc_only
def test_env_helper_pins_the_threshold_of_a_child():
    _assert_stable(_child_peaks("plain", malloc_threshold_env()))


def test_file_backed_bytes_reads_rssfile(tmp_path):
    (tmp_path / "status").write_text("VmHWM:\t  300 kB\nVmRSS:\t  100 kB\nRssAnon:\t  60 kB\nRssFile:\t  40 kB\n")
    assert LinuxProbe(proc_dir=tmp_path).file_backed_bytes() == 40 * 1024
    (tmp_path / "status").write_text("VmHWM:\t  300 kB\nVmRSS:\t  100 kB\n")  # before Linux 4.5
    assert LinuxProbe(proc_dir=tmp_path).file_backed_bytes() is None
    assert LinuxProbe(proc_dir=tmp_path / "gone").file_backed_bytes() is None


# Large free chunks in the heap (blocks allocated before the mmap threshold was pinned, then freed) would
# serve a measured step's blocks unseen; plugged, they cannot, and a large block is mapped fresh instead.
PLUGGED_HEAP = """
import ctypes
from edgetrain.probes.glibc import fix_malloc_mmap_threshold, main_heap_range, plugged_free_heap, release_free_heap
MiB = 1 << 20
libc = ctypes.CDLL(None)
libc.malloc.argtypes, libc.malloc.restype = [ctypes.c_size_t], ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
assert fix_malloc_mmap_threshold(32 * MiB)[0]
blocks = [libc.malloc(4 * MiB) for _ in range(16)]
fix_malloc_mmap_threshold()
for block in blocks[::2]:
    libc.free(block)                       # 8 free 4 MiB chunks between live ones
release_free_heap()
start, end = main_heap_range()
in_heap = lambda address: start <= address < end
probe = libc.malloc(3 * MiB)
assert in_heap(probe), "a freed heap chunk serves a large block"
libc.free(probe)
with plugged_free_heap() as plugged:
    assert plugged >= 8 * 3 * MiB, plugged
    probe = libc.malloc(3 * MiB)
    assert not in_heap(probe), "with the free chunks plugged a large block is mapped fresh"
    libc.free(probe)
probe = libc.malloc(3 * MiB)
assert in_heap(probe), "the plugs are gone afterwards"
"""


@linux_only
@glibc_only
def test_plugged_free_heap_keeps_large_blocks_out_of_free_heap_chunks():
    _run_fresh(PLUGGED_HEAP)
