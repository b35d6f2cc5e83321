"""The paper's central claim in miniature, on real data: on scikit-learn digits, SegProp ends within
1.5 points of end-to-end backprop and above layer-wise training -- at seed 0.

What it is and is not: digits is easy enough that all three methods end within about one point of
each other, and the order of segprop and lw moves with the seed. Seed 0 (the default-run test):
bp 0.9805, lw 0.9861, segprop 0.9916. Seeds 0-4 (tools/bench_segprop.py --only digits --seeds 5):
bp 0.9861, lw 0.9911, segprop 0.9838 on average; segprop is above lw at seed 0 only. Seeds 0-2 (the
slow test): bp 0.9833, lw 0.9916, segprop 0.9851 -- segprop stays within 1.5 points of bp, which the
slow test asserts, but is not above lw on average. The seed-0 test guards this recipe
against regressions; it is not evidence for the paper's segprop > lw claim.

Recipe (also tools/bench_segprop.py --only digits, over several seeds): a small ResNet for 1x8x8
images (cifar stem, one BasicBlock per stage, widths 8/16/32, BatchNorm) whose classifier is the
paper's MLP (GAP, Linear 32 -> 32, ReLU, Linear 32 -> 10; appendix B.2.2); the paper's split of the
last block ("resnet-paper" view), a global head of its back half (last conv + BN) and the MLP, three
segments (stem + block 0 | block 1 | block 2's front); lw with the same segments, GAP + Linear
auxiliary classifiers and a final head stage; AdamW lr 3e-3, batch 32, six epochs per stage (bp: six
epochs), a seeded shuffle; accuracy on the held-out 20% split.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from edgetrain.data import digits_stream, load_digits_split
from edgetrain.data.batch import Batch
from edgetrain.recipes import run_schedule
from edgetrain.models.resnet import ResNetConfig, build_resnet

RECIPE = ("ResNet 8/16/32 + MLP head, resnet-paper view, GH = last conv + BN + MLP, 3 segments, "
          "AdamW 3e-3, batch 32, 6 epochs per stage")
EPOCHS, LR, BATCH = 6, 3e-3, 32
PLAN = {"view": "resnet-paper", "head_blocks": 1, "segments": 3}


class MLPHead(nn.Module):
    def __init__(self, channels: int, hidden: int, classes: int) -> None:
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Linear(channels, hidden)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(self.pool(h).flatten(1))))


def digits_model(seed: int) -> nn.Module:
    model = build_resnet(ResNetConfig(num_classes=10, in_channels=1, stem="cifar", width=8,
                                      blocks_per_stage=(1, 1, 1), seed=seed))
    torch.manual_seed(seed)
    model.head = MLPHead(32, 32, 10)
    return model


def train_digits(method: str, seed: int = 0) -> float:
    """Held-out accuracy of `method` (bp, lw or segprop) with the recipe above."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        stream = digits_stream("train", batch_size=BATCH, image=True, shuffle=True, seed=seed, epochs=None)
        inputs, labels = load_digits_split("test", image=True)
        result = run_schedule(digits_model(seed), stream, method, epochs_per_stage=EPOCHS, optimizer="adamw",
                              lr=LR, seed=seed, eval_batches=[Batch(inputs, labels)],
                              **({} if method == "bp" else PLAN))
        return result.final["accuracy"]
    finally:
        torch.set_num_threads(threads)


def test_seed0_segprop_is_within_one_and_a_half_points_of_bp_and_above_lw():
    bp, lw, segprop = (train_digits(method) for method in ("bp", "lw", "segprop"))
    print(f"digits accuracy: bp {bp:.4f}  lw {lw:.4f}  segprop {segprop:.4f}")
    assert bp > 0.95
    assert segprop >= bp - 0.015
    assert segprop > lw


@pytest.mark.slow
def test_over_three_seeds_segprop_is_within_one_and_a_half_points_of_bp_on_average():
    results = {m: [train_digits(m, seed) for seed in range(3)] for m in ("bp", "lw", "segprop")}
    mean = {m: sum(v) / len(v) for m, v in results.items()}
    print(f"digits accuracy over 3 seeds: {results}; means {mean}")
    assert mean["segprop"] >= mean["bp"] - 0.015
    assert min(results["segprop"]) >= min(results["bp"]) - 0.015
