"""`spill_waiting`: the weights of units whose stage has not begun are mapped from a spill file, not held
in memory. Training is bit-identical with and without it (every stage, a checkpoint load mid-stage
included), the waiting weights are file-backed exactly while they wait, tensor accounting and the
kernel's resident set both drop by about their size, and bad settings or a failed write are named errors
that leave the weights as they were."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import edgetrain
from edgetrain.data import digits_stream
from edgetrain.data.batch import Batch
from edgetrain.methods.segprop.waiting_spill import waiting_tensors
from edgetrain.models.resnet import ResNetConfig, build_resnet
from edgetrain.probes import LinuxProbe
from edgetrain.probes.tensors import TensorAccountant, is_file_backed
from edgetrain.registry import EdgetrainError

pytestmark = pytest.mark.usefixtures("one_thread")
REPO = Path(__file__).resolve().parents[2]
MiB = 2**20


def digits_resnet(width: int = 8, seed: int = 0) -> nn.Module:
    """cifar stem, 4 blocks; the resnet-paper view cuts the last in two: 5 units, 1 in the global head."""
    return build_resnet(ResNetConfig(num_classes=10, in_channels=1, stem="cifar", width=width,
                                     blocks_per_stage=(2, 1, 1), seed=seed))


def digits_batches(count: int, batch_size: int = 16) -> list[Batch]:
    stream = digits_stream("train", batch_size=batch_size, image=True, shuffle=False, epochs=None)
    return [stream.batch(i) for i in range(count)]


def learner(model: nn.Module, method: str = "segprop", **options) -> edgetrain.Learner:
    plan = {"view": "resnet-paper", "head_blocks": 1, "segments": 3} if method == "segprop" else {"segments": 3}
    return edgetrain.Learner(model, method=method, optimizer="adamw", lr=1e-2, probe=False,
                             method_options={**plan, "steps_per_stage": 3, **options})


def tensors_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in [*model.named_parameters(), *model.named_buffers()]}


def file_backed_names(model: nn.Module) -> set[str]:
    return {name for name, t in [*model.named_parameters(), *model.named_buffers()] if is_file_backed(t)}


def assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, different


@pytest.mark.parametrize("method", ["segprop", "lw"])
def test_training_with_the_waiting_weights_spilled_is_bit_identical(method):
    """The weights and BatchNorm statistics at the end of every stage, and after finish(), equal those of
    the same run with everything in memory."""
    batches = digits_batches(12)
    runs = []
    for spill in (False, True):
        model = digits_resnet()
        run = learner(model, method, spill_waiting=spill)
        ends, spilled = [], []
        for batch in batches:
            stage = run.method.stage_index
            run.step(batch)
            if run.method.stage_index != stage or run.method.finished:
                ends.append(tensors_of(model))
                spilled.append(len(file_backed_names(model)))
            if run.method.finished:
                break
        run.finish()
        runs.append((ends, tensors_of(model), spilled))
    (plain_ends, plain_final, _), (spill_ends, spill_final, spilled) = runs
    assert len(plain_ends) == len(spill_ends) == (3 if method == "segprop" else 4)
    for plain, spill in zip(plain_ends, spill_ends):
        assert_equal(plain, spill)
    assert_equal(plain_final, spill_final)
    assert spilled[0] > 0, "the option did nothing: no waiting tensor was ever file-backed"


@pytest.mark.parametrize("where", ["auto", "given"])
def test_waiting_weights_are_file_backed_while_they_wait_and_only_then(tmp_path, where):
    model = digits_resnet()
    before = tensors_of(model)
    run = learner(model, spill_waiting=True, spill_waiting_dir="auto" if where == "auto" else str(tmp_path))
    trainer = run.method
    batch = digits_batches(1)[0]
    run.step(batch)
    names = {id(t): n for n, t in [*model.named_parameters(), *model.named_buffers()]}
    waiting = {names[id(t)] for t in waiting_tensors(trainer.parts, trainer.stage)}
    # Stage 0 trains the stem and blocks 0-1 (units 0, 1); units 2 and 3 (block 2, block 3's front) wait.
    assert waiting and all(n.startswith(("blocks.2.", "blocks.3.conv1", "blocks.3.norm1", "blocks.3.shortcut"))
                           for n in waiting)
    assert file_backed_names(model) == waiting
    on_path = {names[id(p)] for m in trainer.parts.body(trainer.stage) + trainer.parts.head(trainer.stage)
               for p in m.parameters()}
    assert on_path and not on_path & file_backed_names(model)
    assert all(torch.equal(model.state_dict()[n], before[n]) for n in waiting)   # read through the mapping
    directory = trainer.waiting.directory
    assert trainer.waiting.file.parent == directory and [p.name for p in directory.iterdir()] == [trainer.waiting.file.name]
    if where == "given":
        assert directory == tmp_path

    for batch in digits_batches(3):   # into stage 1: block 2 trains, block 3's front waits
        run.step(batch)
    assert trainer.stage_index == 1
    assert file_backed_names(model) == {n for n in waiting if n.startswith("blocks.3.")}
    assert len(list(directory.iterdir())) == 1, "the previous stage's file was not deleted"

    run.finish()
    assert not file_backed_names(model)
    assert not any(is_file_backed(t) for t in [*model.parameters(), *model.buffers()])
    if where == "auto":
        assert not directory.exists()
    else:
        assert list(tmp_path.iterdir()) == []


def test_close_brings_the_weights_back_and_deletes_the_file(tmp_path):
    model = digits_resnet()
    run = learner(model, spill_waiting=True, spill_waiting_dir=str(tmp_path))
    run.step(digits_batches(1)[0])
    assert file_backed_names(model) and list(tmp_path.iterdir())
    run.method.close()
    assert not file_backed_names(model) and list(tmp_path.iterdir()) == []


def test_a_checkpoint_loaded_mid_stage_continues_exactly(tmp_path):
    """Saved in the middle of stage 1 with the option on; loaded into a learner that has already spilled
    its own (differently initialised) waiting weights of the same stage: the re-applied stage maps the
    checkpoint's values, not the stale file, and the run ends where an uninterrupted run without the
    option ends."""
    batches = digits_batches(9)
    straight = learner(digits_resnet())
    for batch in batches:
        straight.step(batch)

    first = learner(digits_resnet(), spill_waiting=True)
    for batch in batches[:4]:
        first.step(batch)
    assert first.method.stage_index == 1 and first.method.stage_step == 1 and file_backed_names(first.model)
    first.save(tmp_path / "mid-stage.safetensors")

    other = digits_resnet(seed=1)
    second = learner(other, spill_waiting=True)
    for batch in batches[:3]:   # into stage 1: its seed-1 waiting weights (block 3's front) are in its file
        second.step(batch)
    assert second.method.stage_index == 1 and file_backed_names(other) == file_backed_names(first.model)
    second.load(tmp_path / "mid-stage.safetensors")
    for batch in batches[4:]:
        second.step(batch)
    assert second.method.finished
    assert_equal(tensors_of(straight.model), tensors_of(other))
    second.finish()
    first.method.close()


def stage0_peak(model: nn.Module, spill: bool, batch: Batch) -> tuple[int, int]:
    """(peak bytes of a steady-state stage-0 step by tensor accounting, bytes of the waiting tensors);
    tools/bench_segprop.py's measured_step."""
    run = learner(model, spill_waiting=spill, head_grads_last=True)
    run.step(batch)
    trainer = run.method
    waiting = sum(t.numel() * t.element_size() for t in waiting_tensors(trainer.parts, trainer.stage))
    accountant = TensorAccountant(model)
    accountant.register(run.optimizer, batch.inputs, batch.targets)
    with accountant:
        trainer.step(batch, run.optimizer)
    trainer.close()
    return accountant.report().peak_bytes, waiting


def test_tensor_accounting_no_longer_charges_the_waiting_weights():
    batch = digits_batches(1)[0]
    plain, waiting = stage0_peak(digits_resnet(width=64), False, batch)
    spilled, _ = stage0_peak(digits_resnet(width=64), True, batch)
    assert waiting > 1 * MiB
    assert plain - spilled >= waiting - 4096, (plain, spilled, waiting)


# A child process (a fresh interpreter, glibc's mmap threshold pinned before torch allocates, as the
# Linux probe's own tests run): ResNet-18 on small images, whose stage 0 leaves 33 MiB of weights waiting.
OS_CHILD = """
import json, sys
from edgetrain.probes import LinuxProbe, fix_malloc_mmap_threshold
fix_malloc_mmap_threshold()
import torch
import edgetrain
from edgetrain.data.batch import Batch
from edgetrain.models.resnet import build_resnet, resnet18_imagenet_config
from edgetrain.methods.segprop.waiting_spill import waiting_tensors
from edgetrain.probes.base import settle_memory
torch.set_num_threads(1)
spill = sys.argv[1] == "on"
probe = LinuxProbe()
generator = torch.Generator().manual_seed(0)
batch = Batch(torch.rand(4, 3, 64, 64, generator=generator), torch.randint(0, 10, (4,), generator=generator), 0)
settle_memory()
baseline = probe.current_bytes()
model = build_resnet(resnet18_imagenet_config(in_channels=3, num_classes=10))
run = edgetrain.Learner(model, method="segprop", optimizer="adamw", lr=1e-4, probe=False,
                        method_options={"view": "resnet-paper", "head_blocks": 1, "segments": 4,
                                        "spill_waiting": spill, "example_input": batch.inputs[:2].clone()})
run.step(batch)
waiting = sum(t.numel() * t.element_size() for t in waiting_tensors(run.method.parts, run.method.stage))
settle_memory()
probe.reset_peak()
for _ in range(2):
    run.step(batch)
assert run.method.stage_index == 0
print(json.dumps({"peak": probe.peak_bytes() - baseline, "waiting": waiting}))
run.finish()
"""


@pytest.mark.skipif(not LinuxProbe().available()[0], reason=f"Linux probe unavailable: {LinuxProbe().available()[1]}")
def test_the_kernel_charges_less_resident_memory_with_the_waiting_weights_spilled():
    figures = {}
    for mode in ("off", "on"):
        done = subprocess.run([sys.executable, "-c", OS_CHILD, mode], capture_output=True, text=True, timeout=180,
                              cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert done.returncode == 0, done.stderr[-3000:]
        figures[mode] = __import__("json").loads(done.stdout.strip().splitlines()[-1])
    waiting = figures["on"]["waiting"]
    assert waiting > 30 * MiB
    saved = figures["off"]["peak"] - figures["on"]["peak"]
    assert saved >= waiting / 2, (figures, saved / MiB)


# -- errors ------------------------------------------------------------------------------------------------

def test_bad_settings_are_named(tmp_path):
    with pytest.raises(EdgetrainError, match="spill_waiting must be true or false"):
        learner(digits_resnet(), spill_waiting="yes")
    missing = tmp_path / "nowhere"
    with pytest.raises(EdgetrainError, match=f"spill_waiting_dir '{missing}' is not an existing directory"):
        learner(digits_resnet(), spill_waiting=True, spill_waiting_dir=str(missing))
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    with pytest.raises(EdgetrainError, match="is not an existing directory"):
        learner(digits_resnet(), spill_waiting=True, spill_waiting_dir=str(a_file))
    with pytest.raises(EdgetrainError, match="spill_waiting_dir must be"):
        learner(digits_resnet(), spill_waiting=True, spill_waiting_dir=3)


def test_a_failed_write_leaves_the_weights_in_memory_and_names_the_file(tmp_path, monkeypatch):
    """A full disk (the write raises half-way): a named error with the file's path, no file left behind,
    every weight in memory with its value; once the disk has room, training goes on exactly."""
    real_save = torch.save

    def full_disk(obj, path, *args, **kwargs):
        Path(path).write_bytes(b"\0" * 1000)
        raise OSError(28, "No space left on device")

    model = digits_resnet()
    run = learner(model, spill_waiting=True, spill_waiting_dir=str(tmp_path))
    before = tensors_of(model)
    batches = digits_batches(6)
    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(EdgetrainError, match=f"could not write {tmp_path}/edgetrain-waiting-.*\\.pt: .*No space"):
        run.step(batches[0])
    assert list(tmp_path.iterdir()) == []
    assert not file_backed_names(model)
    assert_equal(before, tensors_of(model))

    monkeypatch.setattr(torch, "save", real_save)
    run.step(batches[0])
    assert file_backed_names(model)
    for batch in batches[1:]:
        run.step(batch)
    plain = learner(digits_resnet())
    for batch in batches:
        plain.step(batch)
    assert_equal(tensors_of(plain.model), tensors_of(model))
    run.finish()


def test_a_directory_it_cannot_write_is_named(tmp_path, monkeypatch):
    """os.access decides (a root user passes any mode bits, so the refusal is simulated)."""
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: False if mode & os.W_OK else real_access(path, mode))
    with pytest.raises(EdgetrainError, match=f"spill_waiting_dir '{tmp_path}' is not writable"):
        learner(digits_resnet(), spill_waiting=True, spill_waiting_dir=str(tmp_path))


def test_a_failed_mapping_leaves_the_weights_in_memory_and_names_the_file(tmp_path, monkeypatch):
    model = digits_resnet()
    run = learner(model, spill_waiting=True, spill_waiting_dir=str(tmp_path))
    before = tensors_of(model)

    def unreadable(*args, **kwargs):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(torch, "load", unreadable)
    with pytest.raises(EdgetrainError, match=f"could not map {tmp_path}/edgetrain-waiting-.*\\.pt: .*Input/output"):
        run.step(digits_batches(1)[0])
    assert list(tmp_path.iterdir()) == [] and not file_backed_names(model)
    assert_equal(before, tensors_of(model))


def test_a_spill_directory_removed_under_the_run_changes_nothing(tmp_path):
    """A temporary-file cleaner deletes the "auto" directory while its file is mapped: the mapping keeps
    the bytes, training goes on exactly, and finish() has nothing left to delete."""
    import shutil

    model, plain = digits_resnet(), learner(digits_resnet())
    run = learner(model, spill_waiting=True)
    batches = digits_batches(6)
    run.step(batches[0])
    shutil.rmtree(run.method.waiting.directory)
    for batch in batches[1:]:
        run.step(batch)
    for batch in batches:
        plain.step(batch)
    shutil.rmtree(run.method.waiting.directory)  # and the fresh one it made, before finish() cleans up
    run.finish()
    plain.finish()
    assert_equal(tensors_of(plain.model), tensors_of(model))


def test_a_learner_dropped_unclosed_deletes_its_spill_file(tmp_path):
    import gc

    run = learner(digits_resnet(), spill_waiting=True, spill_waiting_dir=str(tmp_path))
    run.step(digits_batches(1)[0])
    assert len(list(tmp_path.iterdir())) == 1
    del run
    gc.collect()
    assert list(tmp_path.iterdir()) == []


def test_a_weight_a_waiting_unit_shares_with_the_path_stays_in_memory():
    model = digits_resnet()
    trainer = learner(model, spill_waiting=True).method
    waiting_unit = trainer.parts.view.units[trainer.stage.end]
    shared = next(waiting_unit.parameters())
    before = waiting_tensors(trainer.parts, trainer.stage)
    assert any(t is shared for t in before)
    trainer.parts.view.head.register_parameter("tied_for_test", shared)  # the head now holds it too
    after = waiting_tensors(trainer.parts, trainer.stage)
    assert not any(t is shared for t in after) and len(after) == len(before) - 1
    trainer.close()
