"""StepStats.peak_bytes is the memory a step adds (edgetrain/step_memory.py): the same whatever the process ran
before, file-backed pages left out, tensor accounting's registered model left out."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import edgetrain
from edgetrain.probes import LinuxProbe, TensorAccountant
from edgetrain.probes.glibc import fix_malloc_mmap_threshold
from edgetrain.step_memory import StepMemory

MIB = 2**20

# The same step in any process: a mesp step of the tiny preset (LoRA r8) on 8 x 512 tokens, which adds about
# 35 MiB (27 MiB of tensors): far above the allocator's noise. Steps 1-4, step 1 warming up.
STEPS = """
import json, sys, torch, edgetrain
sys.path.insert(0, "tests")
from testkit import text_token_batches

def mesp_step_peaks(threads):
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = edgetrain.load_model("tiny")
    edgetrain.add_lora(model, rank=8)
    batch = text_token_batches(1, seq_len=512, batch_size=8)[0]
    learner = edgetrain.Learner(model, method="mesp")
    return [learner.step(batch).peak_bytes for _ in range(4)]
"""


def _leave_free_resident_heap(mebibytes: int) -> list[torch.Tensor]:
    """What a long-lived process holds: free heap chunks that are still resident -- as loading a model
    before the probe pinned glibc's mmap threshold leaves them (12.6 MiB after SmolLM2-135M). Blocks of
    1 MiB come from the heap, every other one is freed; the others are returned, to be kept alive, so
    that the holes between them stay."""
    ok, why = fix_malloc_mmap_threshold(32 * MIB)  # big blocks from the heap, as before a probe pins it
    if not ok:
        pytest.skip(f"needs glibc's allocator: {why}")
    try:
        blocks = [torch.ones(MIB // 4) for _ in range(2 * mebibytes)]
    finally:
        fix_malloc_mmap_threshold()
    return blocks[1::2]


def test_a_steps_peak_bytes_here_is_what_a_fresh_process_measures():
    """In this long-lived process (the tests before this one left its heap full of free, resident chunks)
    and in a fresh one, the same step reads the same: within 1 MiB + 10%. Without giving the free heap
    back before the step, the steps here were served from it and read low."""
    ok, why = LinuxProbe().available()
    if not ok:
        pytest.skip(f"needs the Linux probe: {why}")
    namespace: dict = {}
    exec(STEPS, namespace)  # noqa: S102  (the same code as the fresh process runs)
    threads = torch.get_num_threads()
    kept = _leave_free_resident_heap(24)
    here = namespace["mesp_step_peaks"](threads)
    del kept
    done = subprocess.run([sys.executable, "-c", STEPS + f"print(json.dumps(mesp_step_peaks({threads})))"],
                          cwd=Path(__file__).parent.parent, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    fresh = json.loads(done.stdout.splitlines()[-1])
    assert all(peak > 20 * MIB for peak in fresh), fresh
    for step in (1, 2, 3):  # after the warm-up step
        assert abs(here[step] - fresh[step]) <= MIB + 0.1 * fresh[step], (here, fresh)
    # The first step of a fresh process adds its one-time allocations, and little more.
    assert fresh[0] - fresh[1] <= 4 * MIB, fresh


class _FakeProbe:
    """RSS that rises by `anonymous` + `mapped` during the step, `mapped` of it file-backed."""

    name = "fake"

    def __init__(self, anonymous: int, mapped: int, file_backed: bool = True) -> None:
        self.anonymous, self.mapped, self.file_backed = anonymous, mapped, file_backed
        self.rss, self.files, self.peak = 100 * MIB, 50 * MIB, 0

    def available(self):
        return True, ""

    def reset_peak(self) -> None:
        self.peak = self.rss

    def current_bytes(self) -> int:
        return self.rss

    def peak_bytes(self) -> int:
        return self.peak

    def run_step(self) -> None:
        self.files += self.mapped
        self.peak = self.rss + self.anonymous + self.mapped
        self.rss += self.mapped

    def __getattr__(self, name):
        if name == "file_backed_bytes" and self.__dict__.get("file_backed"):
            return lambda: self.files
        raise AttributeError(name)


def test_pages_mapped_in_from_files_are_not_step_memory():
    probe = _FakeProbe(anonymous=3 * MIB, mapped=40 * MIB)
    with StepMemory(probe) as window:
        probe.run_step()
    assert window.added_bytes == 3 * MIB
    # A probe that cannot tell file pages apart reports everything it saw.
    probe = _FakeProbe(anonymous=3 * MIB, mapped=40 * MIB, file_backed=False)
    with StepMemory(probe) as window:
        probe.run_step()
    assert window.added_bytes == 43 * MIB


def test_a_failed_step_leaves_no_figure_and_closes_the_probe(tiny_lora):
    accountant = TensorAccountant(tiny_lora())
    with pytest.raises(RuntimeError, match="boom"):
        with StepMemory(accountant) as window:
            raise RuntimeError("boom")
    assert window.added_bytes is None and accountant._depth == 0


def test_tensor_accountings_first_step_does_not_count_the_model_it_registers(tiny_lora, text_batches):
    """The accountant registers the model when it is entered; entered after the baseline was read, its
    first step counted the weights as memory the step allocated."""
    model = tiny_lora()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    learner = edgetrain.Learner(model, method="mesp", probe=TensorAccountant(model))
    batch = text_batches(1, seq_len=64)[0]
    first, second = learner.step(batch).peak_bytes, learner.step(batch).peak_bytes
    assert first == second < weights
