"""edgetrain_mesp_runner (targets/executorch/mesp_runner.cpp), built by the top-level CMakeLists.txt: MeSP's
schedule over an exported program and its packed weights file, with no Python, trains the same adapters as
the program's Python replay and as torch's mesp; resumes from its checkpoint bit for bit, also after a kill;
refuses bad or mismatched files with exit status 3 and changes nothing; writes an adapter edgetrain loads."""
from __future__ import annotations

import copy
import itertools
import shutil
import signal
import subprocess

import pytest
import torch

import edgetrain

pytest.importorskip("executorch.exir", reason="ExecuTorch not installed: pip install 'edgetrain[export]'")

from edgetrain.export import make_trainable, write_batch_file  # noqa: E402
from edgetrain.export.mesp_program import (AdamWSettings, MeSPProgramTrainer, export_mesp_program,  # noqa: E402
                                           mesp_reference)
from edgetrain.export.native import MESP_RUNNER, build_runner, run_mesp_runner  # noqa: E402

STEPS = 5
LR = 1e-3


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    if shutil.which("cmake") is None or shutil.which("c++") is None:
        pytest.skip("building the native runner needs cmake and a C++ compiler")
    return build_runner(tmp_path_factory.mktemp("native-build"), target=MESP_RUNNER)


def export_tiny(directory, delegate: str):
    from edgetrain.data import make_stream

    torch.manual_seed(0)
    model = make_trainable(edgetrain.load_model("tiny", quantize_bits=4), "lora", rank=4)
    reference = copy.deepcopy(model)
    program, weights = export_mesp_program(model, 2, 16, directory / "tiny.pte", delegate=delegate)
    batches = list(itertools.islice(make_stream("text", batch_size=2, seq_len=16, vocab_size=256), STEPS))
    batch_file = write_batch_file(directory / "batches.bin", batches)
    return program, weights, batch_file, batches, reference


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """On ExecuTorch's own kernels (15 s to lower; the default, XNNPACK, takes about 3 minutes for tiny): the
    runner's schedule, checkpoints and refusals do not depend on the kernels. The default program is trained by
    the runner in ctest (samples/mesp_app_cpp.py: against the Python replay bit for bit, and torch's mesp)."""
    return export_tiny(tmp_path_factory.mktemp("mesp-runner"), "none")


def test_the_runner_trains_as_the_python_replay_and_torch_mesp(runner, exported, tmp_path):
    program, weights, batch_file, batches, reference = exported
    native = run_mesp_runner(runner, program, batch_file, lr=LR, save=tmp_path / "adapter.safetensors")
    replay = MeSPProgramTrainer(program, weights, AdamWSettings(lr=LR))
    replay_losses = [replay.step(batch) for batch in batches]
    assert native.losses == replay_losses  # the same program on the same inputs: bit for bit
    replay_adapters = replay.adapters()
    assert set(native.adapter) == set(replay_adapters)
    assert all(torch.equal(native.adapter[name], value) for name, value in replay_adapters.items())
    torch_losses, torch_adapters = mesp_reference(copy.deepcopy(reference), batches, AdamWSettings(lr=LR))
    assert max(abs(a - b) for a, b in zip(native.losses, torch_losses)) <= 1e-5
    assert max(float((native.adapter[n] - t).abs().max()) for n, t in torch_adapters.items()) <= 1e-5
    # The adapter file is edgetrain's: `export-adapter` converts it (here to PEFT) and the PEFT directory loads
    # into the model with the runner's weights.
    from edgetrain.adapters.convert import load_adapter
    from edgetrain.cli import main

    assert main(["export-adapter", "--adapter", str(tmp_path / "adapter.safetensors"), "--format", "peft",
                 "-o", str(tmp_path / "peft"), "-q"]) == 0
    model = copy.deepcopy(reference)
    load_adapter(model, tmp_path / "peft")
    assert torch.equal(dict(model.named_parameters())["blocks.3.mlp.down_proj.lora_B"],
                       native.adapter["blocks.3.mlp.down_proj.lora_B"])


def test_resume_from_the_checkpoint_is_bit_for_bit(runner, exported, tmp_path):
    program, _, batch_file, _, _ = exported
    whole = run_mesp_runner(runner, program, batch_file, lr=LR, save=tmp_path / "whole.safetensors")
    checkpoint = tmp_path / "state.ckpt"
    first = run_mesp_runner(runner, program, batch_file, lr=LR, steps=2, checkpoint=checkpoint)
    rest = run_mesp_runner(runner, program, batch_file, lr=LR, checkpoint=checkpoint,
                           save=tmp_path / "resumed.safetensors")
    assert "resumed from" in rest.output and "after step 2" in rest.output
    assert first.losses + rest.losses == whole.losses
    assert all(torch.equal(rest.adapter[name], value) for name, value in whole.adapter.items())


def test_a_kill_mid_run_resumes_to_the_same_adapters(runner, exported, tmp_path):
    program, _, batch_file, _, _ = exported
    whole = run_mesp_runner(runner, program, batch_file, lr=LR, save=tmp_path / "whole.safetensors")
    checkpoint = tmp_path / "state.ckpt"
    process = subprocess.Popen([str(runner), str(program), str(batch_file), "--lr", repr(LR), "--checkpoint",
                                str(checkpoint)], stdout=subprocess.PIPE, text=True)
    for line in process.stdout:  # killed right after step 2's checkpoint began (or ended)
        if line.startswith("step 2 "):
            process.send_signal(signal.SIGKILL)
            break
    process.wait()
    assert process.returncode == -signal.SIGKILL
    resumed = run_mesp_runner(runner, program, batch_file, lr=LR, checkpoint=checkpoint,
                              save=tmp_path / "resumed.safetensors")
    assert resumed.losses == whole.losses[-len(resumed.losses):]
    assert all(torch.equal(resumed.adapter[name], value) for name, value in whole.adapter.items())


def _flip(path, position: int) -> None:
    data = bytearray(path.read_bytes())
    data[position] ^= 0x01
    path.write_bytes(bytes(data))


def test_bad_inputs_exit_3_naming_the_file_and_write_nothing(runner, exported, tmp_path):
    program, weights, batch_file, batches, _ = exported
    copied = tmp_path / "p.pte"
    shutil.copy(program, copied)
    shutil.copy(weights, tmp_path / "p.weights")
    save = tmp_path / "never.safetensors"

    def refused(match: str, *args, **options):
        result = run_mesp_runner(runner, *args, lr=LR, save=save, check=False, **options)
        assert result.returncode == 3, result.error
        assert match in result.error
        assert not save.exists()

    _flip(tmp_path / "p.weights", (tmp_path / "p.weights").stat().st_size - 3)
    refused("checksum", copied, batch_file)
    refused("cannot open the weights file", copied, batch_file, weights=tmp_path / "missing.weights")
    damaged = tmp_path / "damaged.pte"
    shutil.copy(program, damaged)
    _flip(damaged, 200)
    refused("is not the program", damaged, batch_file, weights=weights)
    outside = [copy.deepcopy(batch) for batch in batches[:2]]
    outside[1].inputs[0, 3] = 300
    refused("batch 1: token id 300 outside the vocabulary [0, 256)", program,
            write_batch_file(tmp_path / "outside.bin", outside))
    from edgetrain.data.batch import Batch

    short = [Batch(batch.inputs[:, :8], batch.targets[:, :8], batch.index) for batch in batches[:2]]
    refused("the shape the program was exported for", program, write_batch_file(tmp_path / "short.bin", short))
    checkpoint = tmp_path / "state.ckpt"
    run_mesp_runner(runner, program, batch_file, lr=LR, steps=1, checkpoint=checkpoint)
    _flip(checkpoint, 50)
    before = checkpoint.read_bytes()
    refused("the checkpoint is damaged", program, batch_file, checkpoint=checkpoint)
    assert checkpoint.read_bytes() == before  # a refused run leaves the checkpoint as it was
    usage = run_mesp_runner(runner, program, batch_file, lr=float("nan"), check=False)
    assert usage.returncode == 2 and "--lr" in usage.error
    unwritable = run_mesp_runner(runner, program, batch_file, lr=LR, save=tmp_path / "no-such-dir" / "a.safetensors",
                                 check=False)
    assert unwritable.returncode == 4 and "no-such-dir" in unwritable.error and unwritable.losses == []


def test_an_export_of_format_version_4_is_refused_by_name(runner, exported, tmp_path):
    """Version 4 held 5- and 6-bit codes a byte each where version 5 splits them (mesp_graph.MatrixFormat): the
    program would misread an old file's codes, so the runner and the Python replay refuse it, naming the file and
    both versions, and write nothing."""
    from edgetrain.export.mesp_program import FORMAT_VERSION
    from edgetrain.export.weights_file import WeightsFile, WeightsFileError, write_weights_file

    program, weights, batch_file, _, _ = exported
    assert FORMAT_VERSION == 5
    current = WeightsFile(weights)
    tensors = {name: current.tensor(name).clone() for name in current.entries}
    tensors["program.meta"][0] = 4
    old = write_weights_file(tmp_path / "old.weights", tensors, {**current.manifest, "version": 4})
    save = tmp_path / "never.safetensors"
    result = run_mesp_runner(runner, program, batch_file, weights=old, lr=LR, save=save, check=False)
    assert result.returncode == 3, result.error
    assert f"{old}: not a MeSP program's weights file of format version 5 (it says 4)" in result.error
    assert not save.exists()
    with pytest.raises(WeightsFileError, match=r"old.weights: .*format version 4, this edgetrain reads 5"):
        MeSPProgramTrainer(program, old)


def test_a_checkpoint_of_another_program_is_refused(runner, exported, tmp_path):
    program, _, batch_file, _, reference = exported
    from edgetrain.methods.configs import MeSPConfig

    # The same model and shapes, the loss cut into two chunks: another program.
    other, _ = export_mesp_program(copy.deepcopy(reference), 2, 16, tmp_path / "other.pte",
                                   config=MeSPConfig(loss_chunk=16), delegate="none")
    checkpoint = tmp_path / "state.ckpt"
    run_mesp_runner(runner, other, batch_file, lr=LR, steps=1, checkpoint=checkpoint)
    result = run_mesp_runner(runner, program, batch_file, lr=LR, checkpoint=checkpoint, check=False)
    assert result.returncode == 3 and "a checkpoint of another program" in result.error


def _export_fixture(directory, file_type: str, delegate: str):
    from pathlib import Path

    from edgetrain.data import make_stream

    fixture = Path(__file__).resolve().parent.parent / "fixtures" / "gguf" / f"tiny-{file_type}.gguf"
    torch.manual_seed(0)
    model = make_trainable(edgetrain.load_model(fixture), "lora", rank=4)
    reference = copy.deepcopy(model)
    program, weights = export_mesp_program(model, 2, 16, directory / "kquant.pte", delegate=delegate)
    batches = list(itertools.islice(make_stream("text", batch_size=2, seq_len=16, vocab_size=256), 3))
    return program, weights, write_batch_file(directory / "batches.bin", batches), batches, reference


@pytest.mark.parametrize("delegate", ["none", pytest.param("xnnpack", marks=pytest.mark.slow)])
def test_the_runner_trains_a_q4_k_m_file_as_the_replay_and_torch_mesp(runner, tmp_path, delegate):
    """llama.cpp's Q4_K_M mix (Q4_K, Q6_K) dequantised in the block programs, on ExecuTorch's kernels and on
    XNNPACK (slow lane: its lowering takes minutes): the runner equals the Python replay bit for bit and torch's
    mesp to 1e-5."""
    program, weights, batch_file, batches, reference = _export_fixture(tmp_path, "Q4_K_M", delegate)
    native = run_mesp_runner(runner, program, batch_file, lr=LR, save=tmp_path / "adapter.safetensors")
    replay = MeSPProgramTrainer(program, weights, AdamWSettings(lr=LR))
    assert native.losses == [replay.step(batch) for batch in batches]
    replay_adapters = replay.adapters()
    assert all(torch.equal(native.adapter[name], value) for name, value in replay_adapters.items())
    torch_losses, torch_adapters = mesp_reference(copy.deepcopy(reference), batches, AdamWSettings(lr=LR))
    assert max(abs(a - b) for a, b in zip(native.losses, torch_losses)) <= 1e-5
    assert max(float((native.adapter[n] - t).abs().max()) for n, t in torch_adapters.items()) <= 1e-5


def test_a_full_disk_stops_the_runner_with_a_sentence_and_the_resume_is_bit_for_bit(runner, exported, tmp_path):
    """The runner's checkpoint on a disk that holds one of it but not a second beside it (the atomic replace
    writes the new one before the old one goes): exit status 4 with the sentence, the previous step's
    checkpoint kept, no temporary left; after the disk grows the rerun ends where an uninterrupted run does.
    A --save that cannot fit is refused the same way."""
    import subprocess as sp

    program, _, batch_file, _, _ = exported
    whole = run_mesp_runner(runner, program, batch_file, lr=LR, checkpoint=tmp_path / "whole.ckpt",
                            save=tmp_path / "whole.safetensors")
    size_kib = (tmp_path / "whole.ckpt").stat().st_size // 1024
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = sp.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib * 3 // 2 + 4}k", "tmpfs", str(disk)],
                     capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (not root?): {mounted.stderr.strip()}")
    try:
        full = run_mesp_runner(runner, program, batch_file, lr=LR, checkpoint=disk / "run.ckpt", check=False)
        assert full.returncode == 4 and "no space left on the device to write" in full.error, full.error
        assert len(full.losses) == 2 and [p.name for p in disk.iterdir()] == ["run.ckpt"]
        sp.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)
        resumed = run_mesp_runner(runner, program, batch_file, lr=LR, checkpoint=disk / "run.ckpt",
                                  save=disk / "adapter.safetensors")
        # The step whose checkpoint did not fit is run again: the kept checkpoint is the step before it.
        assert resumed.losses == whole.losses[len(full.losses) - 1:]
        assert all(torch.equal(resumed.adapter[name], value) for name, value in whole.adapter.items())
        sp.run(["umount", "-l", str(disk)], check=True)
        sp.run(["mount", "-t", "tmpfs", "-o", "size=8k", "tmpfs", str(disk)], check=True)  # less than an adapter
        refused = run_mesp_runner(runner, program, batch_file, lr=LR, steps=1, save=disk / "again.safetensors",
                                  check=False)
        assert refused.returncode == 4 and "no space left" in refused.error
        assert not (disk / "again.safetensors").exists() and not (disk / "again.safetensors.tmp").exists()
    finally:
        sp.run(["umount", "-l", str(disk)], capture_output=True)
