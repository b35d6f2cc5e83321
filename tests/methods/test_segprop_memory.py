"""`segprop` with head_grads_last: the same weights as one backward per step, and a stage's peak (by tensor
accounting) that holds none of the global head's parameter gradients."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import edgetrain
from edgetrain.data import digits_stream
from edgetrain.data.batch import Batch
from edgetrain.models.resnet import ResNetConfig, build_resnet
from edgetrain.probes.tensors import TensorAccountant
from edgetrain.registry import EdgetrainError

pytestmark = pytest.mark.usefixtures("one_thread")


def digits_resnet(width: int = 8) -> nn.Module:
    return build_resnet(ResNetConfig(num_classes=10, in_channels=1, stem="cifar", width=width,
                                     blocks_per_stage=(2, 1, 1), seed=0))


def digits_batches(count: int, batch_size: int = 32) -> list[Batch]:
    stream = digits_stream("train", batch_size=batch_size, image=True, shuffle=False, epochs=None)
    return [stream.batch(i) for i in range(count)]


def learner(model: nn.Module, optimizer: str = "adamw", **options) -> edgetrain.Learner:
    return edgetrain.Learner(model, method="segprop", optimizer=optimizer, lr=1e-2, probe=False,
                             method_options={"view": "resnet-paper", "head_blocks": 1, "segments": 3, **options})


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_head_grads_last_trains_exactly_like_one_backward(optimizer):
    """Every stage, with the head on its own cosine (two optimizer sub-steps per step): bit-identical
    weights, BatchNorm statistics included, after 4 steps per stage."""
    states = []
    for split in (False, True):
        model = digits_resnet()
        run = learner(model, optimizer, head_grads_last=split, steps_per_stage=4, lr_schedule="cosine",
                      warmup_steps=1, head_lr_scale=0.5)
        for batch in digits_batches(12):
            run.step(batch)
        assert run.method.finished
        states.append(model.state_dict())
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])


class HeadGradsAtPeak(TensorAccountant):
    """Also records which of `params`' gradients are alive whenever the peak rises."""

    def __init__(self, model: nn.Module, params: list[nn.Parameter]) -> None:
        super().__init__(model)
        self.params = params
        self.grads_at_peak: list[int] = []

    def _note_peak(self) -> None:
        if self._current > self._peak:
            self.grads_at_peak = [i for i, p in enumerate(self.params) if p.grad is not None]
        super()._note_peak()


def stage_peak(split: bool) -> tuple[int, list[int]]:
    """Peak bytes of a steady-state step of stage 0 and the head parameters with a gradient at that peak.
    As on ResNet-18 at 224x224: wide maps early (64 channels at 16x16) hold most activations, and the
    head's last conv (256 -> 256 at 4x4) weighs more than the activations it saves. A plain AdamW: the
    learner's per-step copies (FiniteOptimizerSteps) would make the optimizer step this small model's peak."""
    model = build_resnet(ResNetConfig(num_classes=10, in_channels=1, stem="cifar", width=64,
                                      blocks_per_stage=(1, 1, 1), seed=0))
    method = learner(model, head_grads_last=split).method
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    generator = torch.Generator().manual_seed(0)
    batch = Batch(torch.rand(16, 1, 16, 16, generator=generator), torch.randint(0, 10, (16,), generator=generator), 0)
    method.step(batch, optimizer)   # the optimizer state exists from here on
    head = [p for m in method.parts.head(method.stage) for p in m.parameters() if p.requires_grad]
    accountant = HeadGradsAtPeak(model, head)
    accountant.register(optimizer, batch.inputs, batch.targets)
    with accountant:
        method.step(batch, optimizer)
    return accountant.report().peak_bytes, accountant.grads_at_peak


def test_a_stage_peak_holds_no_head_gradients():
    """Stage 0 (stem + first block + adapter + head): with one backward the head's gradients, made first,
    are alive when the first block's backward peaks; with head_grads_last none is, and the peak is lower."""
    plain_peak, plain_grads = stage_peak(False)
    split_peak, split_grads = stage_peak(True)
    assert plain_grads, "one backward: the head's gradients are alive at the peak"
    assert split_grads == []
    assert split_peak < plain_peak


def test_head_grads_last_is_off_where_it_does_not_apply():
    """lw has no persistent head; checkpointing would recompute the head units (and their BatchNorm
    statistics) once more; a misspelt value is a named error."""
    batch = digits_batches(1)[0]
    checkpointed = learner(digits_resnet(), head_grads_last=True, checkpoint=True)
    checkpointed.step(batch)
    assert not checkpointed.method._splits_backward()
    layer_wise = edgetrain.Learner(digits_resnet(), method="lw", optimizer="adamw", lr=1e-2, probe=False,
                                   method_options={"segments": 2, "head_grads_last": True})
    layer_wise.step(batch)
    assert not layer_wise.method._splits_backward()
    on = learner(digits_resnet(), head_grads_last=True)
    on.step(batch)
    assert on.method._splits_backward()
    with pytest.raises(EdgetrainError, match="head_grads_last"):
        learner(digits_resnet(), head_grads_last="yes")


def test_the_split_backward_skips_a_head_input_the_loss_never_reaches():
    """A head that ignores part of what enters it: that part has no gradient, and the split backward
    gives one backward's gradients."""
    from edgetrain.methods.segprop import head_last

    torch.manual_seed(0)
    body, head = nn.Linear(4, 4), nn.Linear(4, 1)
    inputs = torch.randn(3, 4)

    def gradients(split: bool) -> list[torch.Tensor]:
        used, ignored = body(inputs), body(inputs) * 2
        loss = head(used).square().sum()
        if split:
            head_last.backward(loss, [used, ignored], list(head.parameters()))
        else:
            loss.backward()
        params = [*body.parameters(), *head.parameters()]
        grads = [p.grad.clone() for p in params]
        for p in params:
            p.grad = None
        return grads

    for split, whole in zip(gradients(True), gradients(False)):
        torch.testing.assert_close(split, whole, rtol=1e-6, atol=0)
