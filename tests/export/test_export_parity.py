"""N SGD steps inside ExecuTorch and inside ONNX Runtime training reproduce N steps of the same torch
Learner (plain backprop, SGD): every loss and every trained weight within 1e-5 in fp32.

Two targets, as on a device: the LoRA adapters of a decoder (base frozen) and the head of a classifier
over its frozen features. The ExecuTorch export of the full 4-block `tiny` decoder takes over a minute
on a small CPU (to_edge's passes), so the default run exports a 1-block decoder of the same shape
family (GQA, q/k/v bias, tied embeddings) and `-m slow` runs `tiny` itself.
"""
from __future__ import annotations

import copy
import dataclasses
import itertools

import pytest
import torch

import edgetrain
from edgetrain.data.batch import Batch
from edgetrain.export import (ExportError, example_batch, export_training, load_trainer, make_trainable,
                              read_batch_file, torch_sgd_trajectory, write_batch_file)

TOLERANCE = 1e-5
STEPS = 5


def _needs(runtime: str) -> None:
    if runtime == "executorch":
        pytest.importorskip("executorch.extension.training", reason="ExecuTorch not installed: pip install 'edgetrain[export]'")
    else:
        pytest.importorskip("onnxruntime.training.api",
                            reason="onnxruntime-training not installed: pip install 'edgetrain[export]'")


def _random_lora_b(model: torch.nn.Module, seed: int = 1) -> None:
    # A fresh B is zero, which makes every A gradient zero: a parity test would not see A at all.
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("lora_B"):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)


def lora_decoder(layers: int | None = None) -> torch.nn.Module:
    from edgetrain.models.decoder_presets import tiny_config
    from edgetrain.models.llama import LlamaModel

    torch.manual_seed(0)
    if layers is None:
        model = edgetrain.load_model("tiny")
    else:
        model = LlamaModel(dataclasses.replace(tiny_config(), num_hidden_layers=layers))
        model.init_weights()
    make_trainable(model, "lora", rank=4)
    _random_lora_b(model)
    return model


def digits_head() -> torch.nn.Module:
    model = edgetrain.load_model("mlp-digits")
    return make_trainable(model, "head")


def text_batches(count: int, seq_len: int = 16, batch_size: int = 2) -> list[Batch]:
    from edgetrain.data import text_stream

    return list(itertools.islice(text_stream(seq_len=seq_len, batch_size=batch_size), count))


def digit_batches(count: int, batch_size: int = 16) -> list[Batch]:
    pytest.importorskip("sklearn", reason="the digits stream needs scikit-learn")
    from edgetrain.data import digits_stream

    return list(itertools.islice(digits_stream(batch_size=batch_size), count))


def assert_runtime_matches_torch(model, batches, runtime, path, lr):
    reference = copy.deepcopy(model)
    export_training(model, batches[0], runtime, path)
    trainer = load_trainer(runtime, path, lr, batches[0])
    losses = [trainer.step(batch) for batch in batches]
    ref_losses, ref_weights = torch_sgd_trajectory(reference, batches, lr)
    weights = trainer.parameters()
    assert set(weights) == set(ref_weights)
    assert losses == pytest.approx(ref_losses, abs=TOLERANCE, rel=0)
    for name, ref in ref_weights.items():
        assert weights[name].shape == ref.shape, name
        assert float((weights[name] - ref).abs().max()) <= TOLERANCE, name
    # The weights moved: a runtime that ignored the update would still match step 1's loss.
    start = {name: p.detach() for name, p in model.named_parameters()}
    moved = max(float((ref - start[name]).abs().max()) for name, ref in ref_weights.items())
    assert moved > 100 * TOLERANCE
    return losses


@pytest.mark.parametrize("runtime", ["onnxruntime", "executorch"])
def test_classifier_head_over_frozen_features_matches_torch(runtime, tmp_path):
    _needs(runtime)
    model = digits_head()
    frozen_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    losses = assert_runtime_matches_torch(model, digit_batches(STEPS), runtime,
                                          tmp_path / ("head.pte" if runtime == "executorch" else "head"), lr=0.5)
    assert all(torch.isfinite(torch.tensor(losses)))
    for name, before in frozen_before.items():  # exporting changes nothing in the model itself
        assert torch.equal(dict(model.named_parameters())[name], before)


def test_tiny_lora_matches_torch_in_onnxruntime(tmp_path):
    _needs("onnxruntime")
    assert_runtime_matches_torch(lora_decoder(), text_batches(STEPS), "onnxruntime", tmp_path / "lora", lr=0.05)


def test_lora_decoder_matches_torch_in_executorch(tmp_path):
    _needs("executorch")
    assert_runtime_matches_torch(lora_decoder(layers=1), text_batches(STEPS), "executorch",
                                 tmp_path / "lora.pte", lr=0.05)


@pytest.mark.slow
def test_tiny_lora_matches_torch_in_executorch(tmp_path):
    _needs("executorch")
    assert_runtime_matches_torch(lora_decoder(), text_batches(STEPS, seq_len=32), "executorch",
                                 tmp_path / "tiny-lora.pte", lr=0.05)


@pytest.mark.parametrize("runtime", ["onnxruntime", "executorch"])
def test_a_batch_of_another_shape_is_refused_naming_both_shapes(runtime, tmp_path):
    _needs(runtime)
    model = digits_head()
    batch = example_batch(model, batch_size=4, seq_len=0)
    path = export_training(model, batch, runtime, tmp_path / ("head.pte" if runtime == "executorch" else "head"))
    trainer = load_trainer(runtime, path, 0.1, batch)
    wrong = example_batch(model, batch_size=6, seq_len=0)
    with pytest.raises(ExportError, match=r"\(6, 64\).*exported for \(4, 64\)"):
        trainer.step(wrong)


class _Classifier(torch.nn.Module):
    task = "classify"

    def __init__(self, features) -> None:
        super().__init__()
        self.features = features
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


@pytest.mark.parametrize("features, op", [(lambda x: torch.cummax(x, 1)[0], "aten.cummax.default"),
                                          (lambda x: torch.sort(x, 1)[0], "aten::sort.values")])
def test_an_op_executorch_cannot_run_is_named(features, op, tmp_path):
    _needs("executorch")
    batch = Batch(torch.randn(4, 8), torch.randint(0, 3, (4,)))
    with pytest.raises(ExportError, match=op.replace(".", r"\.")):
        export_training(_Classifier(features), batch, "executorch", tmp_path / "bad.pte")
    assert not (tmp_path / "bad.pte").exists()


@pytest.mark.parametrize("runtime, module", [("executorch", "executorch.exir"), ("onnxruntime", "onnxruntime")])
def test_a_missing_runtime_names_the_extra(runtime, module, monkeypatch, tmp_path):
    monkeypatch.setitem(__import__("sys").modules, module, None)  # import now raises ImportError
    model = digits_head()
    with pytest.raises(ExportError, match=r"pip install 'edgetrain\[export\]'"):
        export_training(model, example_batch(model, 2, 0), runtime, tmp_path / "out")


def test_unknown_runtime_and_part_are_refused(tmp_path):
    model = digits_head()
    with pytest.raises(ExportError, match="known runtimes: executorch, onnxruntime"):
        export_training(model, example_batch(model, 2, 0), "tflite", tmp_path / "x")
    with pytest.raises(ExportError, match="use 'head'"):
        make_trainable(edgetrain.load_model("mlp-digits"), "lora")


def test_batch_file_round_trips(tmp_path):
    batches = text_batches(3) + []
    path = write_batch_file(tmp_path / "b.bin", batches)
    again = read_batch_file(path)
    assert len(again) == 3
    for a, b in zip(batches, again):
        assert torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets)
    odd = Batch(batches[0].inputs[:1], batches[0].targets[:1], 9)
    with pytest.raises(edgetrain.EdgetrainError, match="every batch must match"):
        write_batch_file(tmp_path / "c.bin", [batches[0], odd])
