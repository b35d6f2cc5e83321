"""One step equals its formula: `bp`, `mebp` and `mesp` take theta' = theta - lr * grad L with plain SGD,
the gradient computed here by torch.autograd.grad on the same loss (float64, fixed seeds); LoRA with a
non-default alpha / rank (13 / 4) is scaled as documented, y = x W^T + b + (alpha / r) x A^T B^T."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import edgetrain
from edgetrain.data.batch import Batch
from edgetrain.models.llama import LlamaConfig, LlamaModel
from edgetrain.models.lora import lora_layers
from float64_mlp import mlp_float64
from testkit import random_lora_b

# One intra-op thread (tests/conftest.py: fixed reduction order, no OpenMP spinning).
pytestmark = pytest.mark.usefixtures("one_thread")

LR = 0.1
RANK, ALPHA = 4, 13.0


def feature_batch(seed: int = 0) -> Batch:
    generator = torch.Generator().manual_seed(seed)
    return Batch(torch.randn(12, 8, generator=generator, dtype=torch.float64),
                 torch.randint(0, 3, (12,), generator=generator), 0)


def lora_decoder_float64(seed: int = 0) -> LlamaModel:
    """A two-block decoder, LoRA rank 4 with alpha 13 (scale 3.25, not the default 16 / r), B random so
    that the A gradients are not all zero."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=2, head_dim=8)
    model = LlamaModel(config)
    model.init_weights(std=0.1, seed=seed)
    edgetrain.add_lora(model, rank=RANK, alpha=ALPHA)
    random_lora_b(model, seed + 1, 0.05)
    return model.double()


def token_batch(vocab: int = 97, seed: int = 0) -> Batch:
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randint(0, vocab, (2, 11), generator=generator)
    targets = torch.randint(0, vocab, (2, 11), generator=generator)
    targets[0, :3] = -100  # a masked prompt
    return Batch(inputs, targets, 0)


def autograd_gradient(model: nn.Module, batch: Batch) -> dict[str, torch.Tensor]:
    """d(task loss)/d(trainable parameters) by reverse mode on the plain forward, on a copy (the model,
    its grads and its buffers are left alone)."""
    reference = copy.deepcopy(model)
    params = {name: p for name, p in reference.named_parameters() if p.requires_grad}
    # edgetrain's task losses are cross-entropies computed in float32, and in float64 for a float64 model
    # (edgetrain/training/losses.py, edgetrain.training.precision); the same here, so that the comparison can be exact.
    logits = reference(batch.inputs)
    if getattr(reference, "task", "classify") == "lm":
        loss = F.cross_entropy(logits.flatten(0, -2), batch.targets.flatten(), ignore_index=-100)
    else:
        loss = F.cross_entropy(logits, batch.targets)
    return dict(zip(params, torch.autograd.grad(loss, list(params.values()))))


@pytest.mark.parametrize("method", ["bp", "mebp"])
def test_bp_and_mebp_step_is_sgd_on_the_autograd_gradient(method: str):
    model = mlp_float64()
    batch = feature_batch()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    grads = autograd_gradient(model, batch)
    edgetrain.Learner(model, method=method, optimizer="sgd", lr=LR, probe=False).step(batch)
    for name, param in model.named_parameters():
        assert grads[name].abs().max() > 0, name
        torch.testing.assert_close(param.detach(), before[name] - LR * grads[name], rtol=1e-12, atol=1e-14)


# mesp differentiates by hand in float64, and the model's RMSNorm and loss (which autograd differentiates)
# run in float64 for a float64 model too, so the two agree to rounding (they differ in summation order).
@pytest.mark.parametrize("method,rtol", [("bp", 1e-12), ("mebp", 1e-12), ("mesp", 1e-10)])
def test_lora_step_is_sgd_on_the_autograd_gradient_with_alpha_13_rank_4(method: str, rtol: float):
    model = lora_decoder_float64()
    batch = token_batch()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    grads = autograd_gradient(model, batch)
    assert set(grads) == {n for n in before if n.endswith(("lora_A", "lora_B"))}
    edgetrain.Learner(model, method=method, optimizer="sgd", lr=LR, probe=False).step(batch)
    for name, param in model.named_parameters():
        if name not in grads:
            assert torch.equal(param, before[name]), f"{name} is frozen but changed"
            continue
        assert grads[name].abs().max() > 0, name
        update = param.detach() - before[name]
        expected = -LR * grads[name]
        torch.testing.assert_close(update, expected, rtol=rtol, atol=rtol * float(expected.abs().max()))


def test_lora_forward_adds_alpha_over_rank_times_b_a_to_the_base_weight():
    model = lora_decoder_float64()
    merged, base_only = copy.deepcopy(model), copy.deepcopy(model)
    with torch.no_grad():
        for layer in lora_layers(merged).values():
            # The documented formula written out: W + (alpha / r) B A, and no adapter path left.
            layer.base.weight += (ALPHA / RANK) * layer.lora_B @ layer.lora_A
            layer.lora_B.zero_()
        for layer in lora_layers(base_only).values():
            layer.lora_B.zero_()
        tokens = token_batch().inputs
        adapted, expected, base = model(tokens), merged(tokens), base_only(tokens)
    # The adapters move the logits far more than the tolerance, so a wrong scale cannot hide in it
    # (RMSNorm normalises in float64 for a float64 model: agreement to rounding).
    assert (adapted - base).abs().max() > 1e-2
    torch.testing.assert_close(adapted, expected, rtol=1e-10, atol=1e-10)
