"""One step equals its formula: in every `segprop` stage a step is plain SGD on the stage's loss, and exactly
the stage's active units, its adapter and the persistent global head change -- the frozen prefix and the
later segments do not, and the global head keeps training after stage 0.

The model: a Tanh MLP with units blocks.0 .. blocks.3 and head = Linear; head_blocks=1 makes blocks.3 +
head the global head, segments=3 cuts the body into blocks.0 | blocks.1 | blocks.2; stages 0 and 1 reach
the global head through an adapter (`stage_adapters.<stage>`), stage 2 directly. Float64."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import edgetrain
from edgetrain.data.batch import Batch
from float64_mlp import feature_batches
import float64_mlp

# One intra-op thread (tests/conftest.py: fixed reduction order, no OpenMP spinning).
pytestmark = pytest.mark.usefixtures("one_thread")

LR = 0.1
STEPS_PER_STAGE = 2


def mlp_float64() -> nn.Module:
    return float64_mlp.mlp_float64((6, 5, 7, 6))


def stage_path(model: nn.Module, stage: int) -> tuple[list[nn.Module], list[nn.Module]]:
    """(frozen prefix, trained path) of `stage`, written out from the plan described above."""
    adapter = [model.stage_adapters[str(stage)]] if stage < 2 else []
    return list(model.blocks[:stage]), [model.blocks[stage], *adapter, model.blocks[3], model.head]


def stage_gradient(model: nn.Module, stage: int, batch: Batch) -> dict[str, torch.Tensor]:
    """d(stage loss)/d(the trained path's parameters), on a copy whose every parameter requires grad
    (whatever the method froze or not)."""
    reference = copy.deepcopy(model)
    for param in reference.parameters():
        param.requires_grad_(True)
    prefix, path = stage_path(reference, stage)
    with torch.no_grad():
        h = reference.embed(batch.inputs)
        for module in prefix:
            h = module(h)
    for module in path:
        h = module(h)
    trained = {id(p) for module in path for p in module.parameters()}
    params = {name: p for name, p in reference.named_parameters() if id(p) in trained}
    loss = F.cross_entropy(h, batch.targets)  # the task loss, float64 for float64 as in edgetrain/training/losses.py
    return dict(zip(params, torch.autograd.grad(loss, list(params.values()))))


def test_every_segprop_stage_trains_exactly_its_units_its_adapter_and_the_global_head():
    model = mlp_float64()
    learner = edgetrain.Learner(model, method="segprop", optimizer="sgd", lr=LR, probe=False,
                                method_options={"head_blocks": 1, "segments": 3, "steps_per_stage": STEPS_PER_STAGE})
    method = learner.method
    assert [(s.start, s.end, s.tail_start) for s in method.stages] == [(0, 1, 3), (1, 2, 3), (2, 3, 3)]
    for step, batch in enumerate(feature_batches(3 * STEPS_PER_STAGE)):
        stage = step // STEPS_PER_STAGE
        assert method.stage_index == stage
        before = {name: p.detach().clone() for name, p in model.named_parameters()}
        grads = stage_gradient(model, stage, batch)
        expected = {n for n in before if n.startswith((f"blocks.{stage}.", "blocks.3.", "head."))}
        expected |= {n for n in before if stage < 2 and n.startswith(f"stage_adapters.{stage}.")}
        assert set(grads) == expected
        learner.step(batch)
        for name, param in model.named_parameters():
            if name not in expected:
                assert torch.equal(param, before[name]), f"stage {stage}: {name} is not trained here but changed"
                continue
            assert grads[name].abs().max() > 0, name
            torch.testing.assert_close(param.detach(), before[name] - LR * grads[name], rtol=1e-12, atol=1e-15,
                                       msg=lambda text: f"stage {stage}, {name}: {text}")
    assert method.finished
