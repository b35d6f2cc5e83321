"""Tensor accountant: exact counts on known allocation patterns, agreement with torch's MemTracker,
and the per-block labels of where the peak happened."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils.checkpoint import checkpoint

from edgetrain.models import MODEL_PRESETS
from edgetrain.probes import TensorAccountant, measure

F32 = 4


def test_peak_of_a_known_allocation_pattern_is_exact():
    made_before = torch.ones(10_000)
    with TensorAccountant() as acc:
        a = torch.empty(1000)
        b = torch.empty(2000)
        c = torch.empty(3000)
        view = a.view(10, 100)           # shares a's storage: nothing new
        a.add_(1)                        # in place: nothing new
        made_before.mul_(2)              # created outside the region: not seen
        made_before_view = made_before[:5]
        assert acc.current_bytes() == 6000 * F32
        del b
        assert acc.current_bytes() == 4000 * F32
        d = torch.empty(500)
    report = acc.report()
    assert report.baseline_bytes == 0
    assert report.peak_bytes == 6000 * F32 == acc.peak_bytes()
    assert acc.current_bytes() == 4500 * F32
    del a, view
    assert acc.current_bytes() == 3500 * F32   # a's storage died with its last view
    del c, d, made_before_view
    assert acc.current_bytes() == 0


def test_registered_tensors_form_the_baseline_and_resize_is_recharged():
    outside = torch.zeros(250)
    acc = TensorAccountant()
    acc.register(outside)
    with acc:
        grown = torch.empty(0)
        grown.resize_(1000)
    report = acc.report()
    assert report.baseline_bytes == 250 * F32
    assert report.peak_bytes == 1250 * F32 and report.peak_above_baseline_bytes == 1000 * F32


def test_backward_runs_under_the_mode_and_saved_tensors_are_freed():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 4))
    x = torch.randn(16, 32)
    param_bytes = sum(p.numel() for p in model.parameters()) * F32
    with TensorAccountant(model) as acc:
        with torch.no_grad():
            model(x)                                 # no-grad outputs are storages too
        loss = model(x).square().sum()
        after_forward = acc.current_bytes()
        loss.backward()
        del loss
    assert acc.report().baseline_bytes == param_bytes
    assert after_forward > param_bytes               # activations saved for backward
    # Everything the step made is gone except the gradients, one per parameter.
    assert acc.current_bytes() == 2 * param_bytes
    model.zero_grad(set_to_none=True)
    assert acc.current_bytes() == param_bytes


def test_optimizer_state_can_be_registered():
    model = nn.Linear(10, 10)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 10)).sum().backward()
    opt.step()
    acc = TensorAccountant(model)
    acc.register(opt)
    with acc:
        pass
    n = sum(p.numel() for p in model.parameters())
    # parameters + grads + Adam's exp_avg and exp_avg_sq (+ one scalar step count per parameter)
    assert acc.report().baseline_bytes == 4 * n * F32 + 2 * F32


def test_other_devices_are_not_counted():
    with TensorAccountant(device="cuda") as acc:
        torch.empty(1000)
    assert acc.peak_bytes() == 0


def _mlp_step(model, x):
    model(x).square().mean().backward()


def _tiny_lm_step(model, tokens):
    logits = model(tokens)
    loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())
    del logits
    loss.backward()


@pytest.mark.parametrize("build, make_input, step", [
    (lambda: nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 10)),
     lambda: torch.randn(32, 64), _mlp_step),
    (lambda: MODEL_PRESETS.get("tiny")(), lambda: torch.randint(0, 256, (2, 48)), _tiny_lm_step),
], ids=["mlp", "tiny-transformer"])
def test_peak_agrees_with_torch_memtracker(build, make_input, step):
    torch.manual_seed(0)
    model, x = build(), make_input()
    with TensorAccountant(model) as acc:
        acc.register(x)  # inside the region is fine: registered bytes join the baseline
        step(model, x)
    ours = acc.report()
    assert ours.baseline_bytes == sum(p.numel() for p in model.parameters()) * F32 + x.numel() * x.element_size()
    model.zero_grad(set_to_none=True)
    tracker = MemTracker()
    tracker.track_external(model, x)
    with tracker:
        step(model, x)
    (theirs,) = [snap["Total"] for snap in tracker.get_tracker_snapshot("peak").values()]
    # Both charge each op's new output storages and release them on the storage's weakref; with
    # the same outside tensors registered (parameters and the input) they agree to the byte on CPU.
    # Without registering x, MemTracker would count x when its storage first shows up as an op
    # output (a view of it), we never would: a systematic difference of exactly x's bytes.
    # On CUDA both round to 512-byte blocks.
    assert ours.peak_bytes == theirs
    assert ours.peak_above_baseline_bytes > 0


class Spiky(nn.Module):
    """A block whose forward makes a 4 MB temporary; with `backward_spike`, its backward makes 8 MB."""

    def __init__(self, backward_spike: bool = False) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(8))
        self.backward_spike = backward_spike

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        tmp = torch.zeros(1_000_000)
        del tmp
        h = h * self.scale
        return _SpikyBackward.apply(h) if self.backward_spike else h


class _SpikyBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h):
        return h.clone()

    @staticmethod
    def backward(ctx, grad):
        tmp = torch.zeros(2_000_000)
        del tmp
        return grad * 1.0


class BlockView(nn.Module):
    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 8)
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(8, 2)
        self.checkpointed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=False) if self.checkpointed else block(h)
        return self.head(h)


def test_forward_peak_is_attributed_to_its_block():
    model = BlockView([nn.Identity(), Spiky(), nn.Identity()])
    with TensorAccountant(model) as acc:
        out = model(torch.randn(4, 8))
    report = acc.report()
    assert report.peak_label == "blocks.1 forward"
    above = report.peak_above_baseline_by_label()
    assert 4_000_000 <= above["blocks.1 forward"] < 4_000_000 + 4096
    assert above["blocks.0 forward"] < 4096 and above["blocks.2 forward"] < 4096
    del out


def test_backward_peak_is_attributed_to_its_block_and_labels_end_with_backward():
    # blocks.0 passes its input through: its (empty) backward must not take embed's label.
    model = BlockView([nn.Identity(), Spiky(), Spiky(backward_spike=True), nn.Linear(8, 8)])
    with TensorAccountant(model) as acc:
        model(torch.randn(4, 8)).sum().backward()
        label_after_backward = acc.label
    report = acc.report()
    assert report.peak_label == "blocks.2 backward"
    above = report.peak_above_baseline_by_label()
    assert 8_000_000 <= above["blocks.2 backward"] < 8_000_000 + 8192
    assert above["blocks.1 forward"] < above["blocks.2 backward"]
    labels = set(report.peak_bytes_by_label)
    assert {"embed forward", "head forward", "head backward", "blocks.3 backward", "blocks.1 backward",
            "embed backward"} <= labels
    assert "blocks.0 backward" not in labels
    assert label_after_backward == "(unlabelled)"


def test_explicit_regions_label_and_nest():
    with TensorAccountant() as acc:
        with acc.region("optimizer step"):
            a = torch.empty(100)
            with acc.region("block 3 backward"):
                assert acc.label == "block 3 backward"
                b = torch.empty(1000)
                del b
            assert acc.label == "optimizer step"
    report = acc.report()
    assert report.peak_label == "block 3 backward"
    # Each label's peak includes what was live when it began: `a` outlives its region.
    assert report.peak_bytes_by_label == {"(unlabelled)": 100 * F32, "optimizer step": 100 * F32,
                                          "block 3 backward": 1100 * F32}
    del a


def test_checkpointed_block_recompute_has_its_own_label():
    model = BlockView([Spiky(), Spiky()])
    model.checkpointed = True
    with TensorAccountant(model) as acc:
        model(torch.randn(4, 8)).sum().backward()
    above = acc.report().peak_above_baseline_by_label()
    # The forward is re-run inside backward; its 4 MB temporary shows up under "recompute".
    assert 4_000_000 <= above["blocks.1 recompute"] < 4_000_000 + 8192
    assert {"blocks.0 recompute", "blocks.0 backward", "blocks.1 backward"} <= set(above)


def test_measure_enters_the_accountant_and_matches_its_report():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 128), nn.ReLU(), nn.Linear(128, 1))
    x = torch.randn(64, 16)
    acc = TensorAccountant(model)
    peak = measure(acc, lambda: _mlp_step(model, x))
    assert peak == acc.report().peak_above_baseline_bytes > 64 * 128 * F32
