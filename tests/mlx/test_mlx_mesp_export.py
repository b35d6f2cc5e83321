"""MeSP as MLX exported functions (`edgetrain export --method mesp --runtime mlx`): replayed with
mx.import_function, as an app would, the step trains the same adapters as MLX's own mesp learner, with a
dense or a 4-bit base; one block function serves every block; damaged or foreign files, bad batches and
non-finite steps are refused with nothing changed."""
from __future__ import annotations

import copy
import itertools
import json
import shutil

import pytest

mx = pytest.importorskip("mlx.core", reason="mlx is not installed (pip install edgetrain[mlx])")

import edgetrain  # noqa: E402
from edgetrain.backends.mlx.lora import add_lora, trainable_parameters  # noqa: E402
from edgetrain.export import ExportError  # noqa: E402
from edgetrain.export.mlx_program import MLXProgramTrainer, export_mlx_mesp  # noqa: E402
from edgetrain.methods.base import NonFiniteError  # noqa: E402

BATCH, SEQ, LR = 2, 16, 1e-3


def lora_tiny(quantize_bits: int | None = None, layers: int | None = None):
    mx.random.seed(0)
    model = edgetrain.load_model("tiny", backend="mlx", quantize_bits=quantize_bits)
    if layers is not None:
        model.blocks = model.blocks[:layers]
    add_lora(model, rank=4)
    return model


def text_batches(count: int) -> list:
    from edgetrain.data import make_stream

    return list(itertools.islice(make_stream("text", batch_size=BATCH, seq_len=SEQ, vocab_size=256), count))


def _max_difference(first: dict, second: dict) -> float:
    assert set(first) == set(second)
    return max(float(mx.max(mx.abs(first[name] - second[name]))) for name in first)


@pytest.mark.parametrize("bits", [None, 4])
def test_the_functions_train_as_mlx_mesp(bits, tmp_path):
    model = lora_tiny(bits)
    reference = copy.deepcopy(model)
    directory = export_mlx_mesp(model, BATCH, SEQ, tmp_path / "program")
    if bits:  # the base stays packed in the weights file
        assert mx.load(str(directory / "weights.safetensors"))["blocks.0.mlp.up_proj.linear.weight"].dtype == mx.uint32
    batches = text_batches(4)
    # A large weight decay, so that its term is well above the tolerance.
    trainer = MLXProgramTrainer(directory, lr=LR, weight_decay=0.5)
    losses = [trainer.step(b.inputs.numpy(), b.targets.numpy()) for b in batches]
    learner = edgetrain.Learner(reference, method="mesp", backend="mlx", optimizer="adamw", lr=LR,
                                optimizer_options={"weight_decay": 0.5})
    assert losses == pytest.approx([learner.step(b).loss for b in batches], abs=1e-6, rel=0)
    assert _max_difference(trainer.adapters(), trainable_parameters(reference)) <= 1e-6
    start = trainable_parameters(lora_tiny(bits))
    assert _max_difference({n: trainer.adapters()[n] for n in start if n.endswith("lora_b")},
                           {n: v for n, v in start.items() if n.endswith("lora_b")}) > 1e-4  # it trained


def test_one_block_function_serves_every_block(tmp_path):
    four = export_mlx_mesp(lora_tiny(), BATCH, SEQ, tmp_path / "four")
    one = export_mlx_mesp(lora_tiny(layers=1), BATCH, SEQ, tmp_path / "one")
    for name in ("block_forward", "block_backward"):
        assert (four / f"{name}.mlxfn").stat().st_size == (one / f"{name}.mlxfn").stat().st_size
    assert json.loads((four / "manifest.json").read_text())["blocks"] == 4


def test_bad_files_batches_and_steps_are_refused_with_nothing_changed(tmp_path):
    directory = export_mlx_mesp(lora_tiny(), BATCH, SEQ, tmp_path / "program")
    broken = tmp_path / "broken"
    shutil.copytree(directory, broken)
    (broken / "block_backward.mlxfn").write_bytes(b"not a function")
    with pytest.raises(ExportError, match="block_backward.mlxfn: 14 bytes, but manifest.json records"):
        MLXProgramTrainer(broken)
    (broken / "manifest.json").unlink()
    with pytest.raises(ExportError, match="manifest"):
        MLXProgramTrainer(broken)
    other = export_mlx_mesp(lora_tiny(layers=1), BATCH, SEQ, tmp_path / "other")
    shutil.copy(other / "weights.safetensors", tmp_path / "program" / "weights.safetensors")
    with pytest.raises(ExportError, match="weights.safetensors: .* a truncated, extended or foreign file"):
        MLXProgramTrainer(directory)

    directory = export_mlx_mesp(lora_tiny(), BATCH, SEQ, tmp_path / "again")
    trainer = MLXProgramTrainer(directory, lr=LR)
    batch = text_batches(1)[0]
    before = dict(trainer.adapters())
    ids = batch.inputs.numpy().copy()
    ids[0, 0] = 999
    with pytest.raises(ExportError, match="outside the vocabulary"):
        trainer.step(ids, batch.targets.numpy())
    with pytest.raises(ExportError, match="fixed at export"):
        trainer.step(batch.inputs.numpy()[:, :8], batch.targets.numpy()[:, :8])
    backward = trainer.functions["block_backward"]

    def poisoned(*arrays):
        grad, *lora = backward(*arrays)
        return [grad, lora[0] * float("nan"), *lora[1:]]

    trainer.functions["block_backward"] = poisoned
    with pytest.raises(NonFiniteError, match="nothing was changed"):
        trainer.step(batch.inputs.numpy(), batch.targets.numpy())
    assert trainer.steps_done == 0
    assert _max_difference(before, trainer.adapters()) == 0.0


def test_the_cli_writes_and_checks_mlx_functions(tmp_path, capsys):
    from edgetrain.cli import main

    out = tmp_path / "cli-mlx"
    code = main(["export", "--method", "mesp", "--runtime", "mlx", "--model", "tiny", "--rank", "4", "--seq", str(SEQ),
                 "--batch", str(BATCH), "--out", str(out), "--check", "2"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    report = json.loads(printed.strip().splitlines()[-1])
    assert report["runtime"] == "mlx" and report["max_loss_error"] <= 1e-6 and report["max_adapter_error"] <= 1e-6
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["adamw.mlxfn", "block_backward.mlxfn", "block_forward.mlxfn", "embed.mlxfn", "head.mlxfn", "manifest.json",
         "weights.safetensors"])
