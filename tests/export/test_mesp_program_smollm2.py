"""Slow lane: SmolLM2-135M from its GGUF, base kept packed, as a MeSP program: the loss and every block's
adapter gradient in ExecuTorch equal torch's mesp on the same batch (1e-4 relative)."""
from __future__ import annotations

import copy
import itertools

import pytest
import torch

import edgetrain

pytestmark = pytest.mark.slow
pytest.importorskip("executorch.exir", reason="ExecuTorch not installed: pip install 'edgetrain[export]'")


def test_smollm2_packed_program_gradients_equal_torch_mesp(smollm2_file, tmp_path):
    from edgetrain.data import make_stream
    from edgetrain.export import make_trainable
    from edgetrain.export.mesp_program import MeSPProgramTrainer, export_mesp_program
    from edgetrain.export.weights_file import WeightsFile
    from edgetrain.training.learner import Learner

    torch.manual_seed(0)
    model = make_trainable(edgetrain.load_model(smollm2_file), "lora", rank=8)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # a fresh B is zero, which would make every A gradient zero
        for name, param in model.named_parameters():
            if name.endswith("lora_B"):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.01)
    reference = copy.deepcopy(model)
    program, weights = export_mesp_program(model, 1, 32, tmp_path / "smollm2.pte")
    # The GGUF's Q4_1 blocks, packed: 4-bit codes in the int8 row_halves layout (edgetrain/export/mesp_graph.py).
    assert WeightsFile(weights).tensor("blocks.0.q.codes").dtype == torch.int8
    batch = next(iter(itertools.islice(make_stream("text", batch_size=1, seq_len=32, vocab_size=49152), 1)))
    trainer = MeSPProgramTrainer(program, weights)
    cos, sin = trainer._rope
    hidden = trainer._run("embed", (batch.inputs, *trainer._embed))[0]
    inputs = []
    for adapters, frozen in zip(trainer._adapters, trainer._blocks):
        inputs.append(hidden)
        hidden = trainer._run("block_forward", (hidden, cos, sin, adapters, *frozen))[0]
    loss, grad = trainer._run("head", (hidden, batch.targets, *trainer._head))
    program_grads = {}
    layout = trainer.weights.manifest["block"]["adapters"]
    for index in reversed(range(len(inputs))):
        grad, flat = trainer._run("block_backward", (inputs[index], grad, cos, sin, trainer._adapters[index],
                                                     *trainer._blocks[index]))
        for item in layout:
            rows, cols = item["shape"]
            program_grads[f"blocks.{index}.{item['name']}"] = flat[item["offset"]:item["offset"] + rows * cols].view(rows, cols)
    torch_loss, torch_grads = Learner(reference, method="mesp").compute_gradients(batch)
    assert abs(float(loss) - float(torch_loss)) <= 1e-4 * abs(float(torch_loss))
    assert set(program_grads) == set(torch_grads)
    for name, expected in torch_grads.items():
        error = float((program_grads[name] - expected).abs().max())
        assert error <= 1e-4 * float(expected.abs().max()), name
