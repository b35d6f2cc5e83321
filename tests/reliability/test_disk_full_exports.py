"""A full disk under every exporter: the .pte and its weights file (`export --method mesp`), a joint .pte,
ONNX Runtime's artifacts, batch files, merged models, adapters in every format, the profile's output. Each is
a named DiskFullError (exit 2 and one sentence through the CLI) saying the path, what it needs and what is
free; what was there before is intact and no temp is left. Where the size is known ahead the export is
refused before its slow part (an ExecuTorch lowering takes minutes with XNNPACK) or before writing.

On a real tmpfs (root, as in CI; skipped elsewhere: test_disk_full.small_disk) and with ENOSPC injected at the
write (os.fsync raising it, as NFS and some flash file systems report a full disk)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import fault_tally
from edgetrain.files.space import DiskFullError
from test_disk_full import _enospc, cli_refuses, fill_up, small_disk  # noqa: F401  (small_disk: the fixture)

PREVIOUS = b"the previous export, which a full disk must not touch"


def _previous(*paths: Path) -> None:
    """What an earlier export left at `paths` (a file, or a directory with one file when the name has no
    suffix)."""
    for path in paths:
        if path.suffix:
            path.write_bytes(PREVIOUS)
        else:
            path.mkdir()
            (path / "weights.bin").write_bytes(PREVIOUS)


def _intact(disk: Path, *paths: Path) -> None:
    """The earlier export as it was, and nothing else on the disk (no temp, no half of a new export)."""
    for path in paths:
        assert (path if path.suffix else path / "weights.bin").read_bytes() == PREVIOUS, path
        if not path.suffix:
            assert [p.name for p in path.iterdir()] == ["weights.bin"]
    assert sorted(p.name for p in disk.iterdir()) == sorted(p.name for p in paths)


def _never(what: str):
    def called(*_args, **_kwargs):
        raise AssertionError(f"{what} ran, though the disk could not hold the export")
    return called


MESP = ["export", "--method", "mesp", "--delegate", "none", "--model", "tiny", "--seq", "16", "--batch", "2",
        "--quiet"]


def test_a_mesp_program_whose_weights_cannot_fit_is_refused_before_lowering(small_disk, monkeypatch, capsys):
    pytest.importorskip("executorch", reason="the export extra")
    import edgetrain.export.executorch as executorch

    monkeypatch.setattr(executorch, "lower_methods", _never("the lowering"))
    disk = small_disk(1024)
    out, weights = disk / "tiny.pte", disk / "tiny.weights"
    _previous(out, weights)
    cli_refuses([*MESP, "--out", str(out)], capsys, f"the program's weights file {weights}: it needs 3.2 MiB",
                "free in")
    _intact(disk, out, weights)


def test_a_mesp_program_and_weights_file_that_fit_only_one_at_a_time_are_refused_together(small_disk, monkeypatch,
                                                                                          capsys):
    """3400 KiB hold the weights file (3.4 MB, checked before lowering) but not it and the program (0.1 MB more):
    after the lowering both sizes are known and neither is written, so the previous pair stays a matching pair.
    The lowering itself (25 s with ExecuTorch's own kernels, minutes with XNNPACK, 100 s on a busy CI core) gives
    bytes of the size of tiny's program here: what is tested is what follows it."""
    pytest.importorskip("executorch", reason="the export extra")
    import edgetrain.export.executorch as executorch

    monkeypatch.setattr(executorch, "lower_methods", lambda *_args: b"\0" * 121_416)
    disk = small_disk(3400)
    out, weights = disk / "tiny.pte", disk / "tiny.weights"
    _previous(out, weights)
    cli_refuses([*MESP, "--out", str(out)], capsys, f"the program's weights file {weights} and tiny.pte beside it: "
                "they need 3.4 MiB")
    _intact(disk, out, weights)


def test_a_joint_program_whose_weights_cannot_fit_is_refused_before_lowering(small_disk, monkeypatch, capsys):
    pytest.importorskip("executorch", reason="the export extra")
    monkeypatch.setattr(torch.export, "export", _never("torch.export"))
    disk = small_disk(1024)
    out = disk / "tiny.pte"
    _previous(out)
    cli_refuses(["export", "--model", "tiny", "--rank", "2", "--seq", "16", "--batch", "2", "--out", str(out),
                 "--quiet"], capsys, f"the program {out}: it needs 3.0 MiB")
    _intact(disk, out)


def test_a_joint_program_larger_than_the_disk_once_serialised_is_refused_before_writing(small_disk):
    """The MLP's weights (10 KB) fit 16 KiB, its serialised program (20 KB) does not: known once lowered."""
    pytest.importorskip("executorch", reason="the export extra")
    import edgetrain
    from edgetrain.export import example_batch, make_trainable
    from edgetrain.export.executorch import export_executorch

    torch.manual_seed(0)
    model = make_trainable(edgetrain.load_model("mlp-digits"), "head")
    disk = small_disk(16)
    out = disk / "head.pte"
    _previous(out)
    fault_tally.refused("full disk", lambda: export_executorch(model, example_batch(model, 8, 1), out),
                        match=f"{out}: it needs 20,")
    _intact(disk, out)


ORT = ["export", "--model", "tiny", "--runtime", "onnxruntime", "--rank", "2", "--seq", "16", "--batch", "2",
       "--quiet"]


@pytest.mark.parametrize("size_kib, says", [
    (1024, "it needs 3.0 MiB"),  # the checkpoint's weights alone do not fit: refused before building
    (3300, "it did not fit (it needs at least 3.0 MiB)"),  # they fit, the models beside them do not
])
def test_onnxruntime_artifacts_on_a_full_disk_keep_the_previous_directory(small_disk, capsys, size_kib, says):
    """The part-way case is ONNX Runtime's own checkpoint writer running out (it says so only in its message)."""
    pytest.importorskip("onnxruntime.training.api", reason="the export extra")
    disk = small_disk(size_kib)
    out = disk / "ort"
    _previous(out)
    cli_refuses([*ORT, "--out", str(out)], capsys, f"directory {out}: {says}")
    _intact(disk, out)


def test_a_batch_file_that_cannot_fit_is_refused_before_writing(small_disk):
    from edgetrain.data import make_stream
    from edgetrain.export import write_batch_file

    stream = make_stream("text", batch_size=8, seq_len=128, vocab_size=256)
    batches = [stream.batch(index) for index in range(20)]
    disk = small_disk(64)
    out = disk / "batches.bin"
    _previous(out)
    fault_tally.refused("full disk", lambda: write_batch_file(out, batches), match=f"{out}: it needs 327,")
    _intact(disk, out)


def test_a_weights_file_that_cannot_fit_is_refused_before_writing(small_disk):
    from edgetrain.export.weights_file import write_weights_file

    disk = small_disk(64)
    out = disk / "tiny.weights"
    _previous(out)
    tensors = {"blocks.0.w": torch.ones(50_000)}
    fault_tally.refused("full disk", lambda: write_weights_file(out, tensors, {"format": "test"}),
                        match=f"{out}: it needs 200,")
    _intact(disk, out)



def test_mlx_functions_whose_weights_cannot_fit_are_refused_before_tracing(small_disk, monkeypatch):
    mx = pytest.importorskip("mlx.core", reason="the mlx extra")
    import edgetrain
    from edgetrain.backends.mlx.lora import add_lora

    monkeypatch.setattr(mx, "export_function", _never("the tracing"))
    from edgetrain.export.mlx_program import export_mlx_mesp

    model = edgetrain.load_model("tiny", backend="mlx")
    add_lora(model, rank=4)
    disk = small_disk(1024)
    out = disk / "program"
    _previous(out)
    fault_tally.refused("full disk", lambda: export_mlx_mesp(model, 2, 16, out), match=f"directory {out}: it needs")
    _intact(disk, out)

@pytest.fixture(scope="module")
def adapter(tmp_path_factory) -> Path:
    """An edgetrain adapter of the tiny preset (rank 8: 0.3 MB)."""
    import edgetrain
    from edgetrain.models.lora import save_lora

    torch.manual_seed(0)
    model = edgetrain.load_model("tiny")
    edgetrain.add_lora(model, rank=8)
    return save_lora(model, tmp_path_factory.mktemp("adapter") / "adapter.safetensors")


@pytest.mark.parametrize("fmt, name", [("edgetrain", "out.safetensors"), ("peft", "peft"), ("gguf", "out.gguf"),
                                       ("mlx-lm", "mlx")])
def test_export_adapter_to_a_full_disk_is_refused_before_writing(small_disk, adapter, capsys, fmt, name):
    disk = small_disk(64)
    out = disk / name
    _previous(out)
    cli_refuses(["export-adapter", "--adapter", str(adapter), "--format", fmt, "--model", "tiny", "--out", str(out),
                 "--quiet"], capsys, f"{out}: it needs ", "free in")
    _intact(disk, out)


@pytest.mark.parametrize("fmt, name", [("edgetrain", "out.safetensors"), ("peft", "peft"), ("gguf", "out.gguf")])
def test_an_adapter_whose_write_runs_out_part_way_keeps_the_previous_one(tmp_path, adapter, monkeypatch, fmt, name):
    from edgetrain.adapters.convert import convert_adapter
    from edgetrain.models.decoder_config import decoder_config

    out = tmp_path / "disk" / name
    out.parent.mkdir()
    _previous(out)
    config = decoder_config("tiny")
    monkeypatch.setattr(os, "fsync", _enospc)
    error = fault_tally.refused("full disk", lambda: convert_adapter(adapter, out, fmt, "tiny", config),
                                match=f"{out}: it did not fit")
    assert isinstance(error, DiskFullError)
    monkeypatch.undo()
    _intact(out.parent, out)


def test_a_merged_checkpoint_directory_that_cannot_fit_is_refused_before_writing(small_disk, capsys, adapter):
    disk = small_disk(1024)
    out = disk / "merged"
    _previous(out)
    cli_refuses(["export", "--merge", "--model", "tiny", "--adapter", str(adapter), "--out", str(out), "--quiet"],
                capsys, f"directory {out}: it needs 2.9 MiB")
    _intact(disk, out)


def test_the_profile_output_on_a_full_disk_is_refused_before_writing(small_disk):
    from edgetrain.profiler.report import write_json

    disk = small_disk(64)
    out = disk / "profile.json"
    _previous(out)
    fill_up(disk, leave=0)
    from test_crash_safe_saves import _profile_records

    records = _profile_records(0) * 10
    fault_tally.refused("full disk", lambda: write_json(records, out), match=f"{out}: it needs")
    assert out.read_bytes() == PREVIOUS
    assert sorted(p.name for p in disk.iterdir()) == ["another-app.bin", "profile.json"]
