"""Method claims checked on real Fashion-MNIST (Debian's `dataset-fashion-mnist`), not only on digits.

Data: the FIRST 3,000 training images and the FIRST 1,000 test images as shipped (the files are in
random class order: 282-321 training and 87-115 test images per class), flat 784-pixel float32
vectors in [0, 1]. One thread, seeded shuffle.

Recipe for bp, segprop, lw and scpl: a 784-256-128-64-10 ReLU MLP (edgetrain.models.mlp, weights
seeded by the run seed), Adam 1e-3, batch 128, 12 passes over the 3,000 images for every method:
bp and scpl 12 epochs, segprop 2 stages x 6 epochs (GH = the last hidden layer + the output layer,
body split 1 | 1), lw 3 stages x 4 epochs (body split 2 | 1, then the head stage). scpl: 3
components (embed+blocks.0 | blocks.1 | blocks.2+head), one view (flat features), projection MLP
(128, 128). fgd: its own small-budget recipe, a 784-32-10 Tanh MLP, plain SGD 3e-3, batch 32,
20 epochs (forward gradients are slow, so only "it learns" is claimed).

Held-out accuracy measured with this recipe (about 2-5 s per run on one core of the shared machine):

| method     | seed 0 | seed 1 | seed 2 | seed 3 | seed 4 |
| ---        | ---:   | ---:   | ---:   | ---:   | ---:   |
| untrained  | 0.090  | 0.095  | 0.142  | 0.128  | 0.108  |
| bp         | 0.820  | 0.830  | 0.834  | 0.810  | 0.815  |
| segprop    | 0.813  | 0.795  | 0.826  | 0.800  | 0.793  |
| lw         | 0.730  | 0.722  | 0.742  | 0.745  | 0.748  |
| scpl       | 0.820  | 0.773  | 0.833  | 0.828  | 0.822  |
| early_exit | 0.831  | 0.832  | 0.821  | 0.809  | 0.809  |
| fgd        | 0.635  | 0.618  | 0.630  |        |        |

Not claimed here: SCPL above early_exit (the paper's ordering) -- early_exit is higher at seeds 0-1
on this budget; nor scpl within 4 points of bp at every seed (seed 1: 5.7 points below).
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import edgetrain
from edgetrain.data import FASHION_MNIST_DIR, ArrayStream, load_fashion_mnist
from edgetrain.data.batch import Batch
from edgetrain.recipes import run_schedule
from edgetrain.models.mlp import MLPConfig, build_mlp

pytestmark = pytest.mark.skipif(not FASHION_MNIST_DIR.is_dir(),
                                reason="Fashion-MNIST not installed: apt-get install dataset-fashion-mnist")

TRAIN_IMAGES, TEST_IMAGES = 3000, 1000
BATCH, LR, PASSES = 128, 1e-3, 12

Data = tuple[torch.Tensor, torch.Tensor, list[Batch]]


def scpl_options(seed: int) -> dict:
    return {"projection_dims": (128, 128), "seed": seed}  # the seed draws the projection heads' weights


@pytest.fixture(scope="module", autouse=True)
def one_thread_for_the_module():
    """One intra-op thread for the module-scoped runs too (conftest's `one_thread` is per test):
    a fixed reduction order, so the measured numbers above reproduce, and no OpenMP spinning on the
    shared 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def fashion() -> Data:
    train_x, train_y = load_fashion_mnist("train")
    test_x, test_y = load_fashion_mnist("test")
    return train_x[:TRAIN_IMAGES], train_y[:TRAIN_IMAGES], [Batch(test_x[:TEST_IMAGES], test_y[:TEST_IMAGES])]


def mlp(seed: int) -> nn.Module:
    return build_mlp(MLPConfig(input_shape=(784,), hidden_sizes=(256, 128, 64), activation="relu", seed=seed))


def learner_curve(data: Data, method: str, seed: int, options: dict | None = None) -> list[dict[str, float]]:
    """Held-out metrics of the untrained model, then after each of the PASSES epochs."""
    train_x, train_y, test = data
    learner = edgetrain.Learner(mlp(seed), method=method, optimizer="adam", lr=LR, probe=False, seed=seed,
                                method_options=options)
    stream = ArrayStream(train_x, train_y, batch_size=BATCH, seed=seed, epochs=PASSES)
    curve = [learner.evaluate(test)]
    for batch in stream:
        learner.step(batch)
        if (batch.index + 1) % stream.batches_per_epoch == 0:
            curve.append(learner.evaluate(test))
    return curve


def staged_accuracy(data: Data, method: str, seed: int, epochs_per_stage: int, **plan: int) -> float:
    """Held-out accuracy of the plain model after a whole segprop/lw schedule (adapters removed)."""
    train_x, train_y, test = data
    stream = ArrayStream(train_x, train_y, batch_size=BATCH, seed=seed)
    result = run_schedule(mlp(seed), stream, method, epochs_per_stage=epochs_per_stage, optimizer="adam", lr=LR,
                          seed=seed, eval_batches=test, **plan)
    assert result.steps == PASSES * stream.batches_per_epoch  # the same number of passes as bp
    return result.final["accuracy"]


def segprop_accuracy(data: Data, seed: int) -> float:
    return staged_accuracy(data, "segprop", seed, PASSES // 2, head_blocks=1, segments=2)


@pytest.fixture(scope="module")
def bp_curve(fashion: Data) -> list[dict[str, float]]:
    return learner_curve(fashion, "bp", seed=0)


def test_bp_learns_real_fashion_mnist(bp_curve):
    untrained, first_epoch, final = bp_curve[0], bp_curve[1], bp_curve[-1]
    losses = [round(m["loss"], 3) for m in bp_curve]
    print(f"bp held-out loss per epoch {losses}; accuracy {untrained['accuracy']:.3f} -> {final['accuracy']:.3f}")
    assert untrained["accuracy"] < 0.2  # measured 0.090: the start is chance, so what follows was learned
    assert final["accuracy"] >= 0.76  # measured 0.820 (seeds 0-4: 0.810-0.834); chance is 0.10
    # Held-out loss: 2.309 untrained, 1.112 after one epoch, 0.487 at the end (seeds 0-4: 0.487-0.527).
    assert first_epoch["loss"] < 0.8 * untrained["loss"]
    assert final["loss"] <= 0.65 and final["loss"] < first_epoch["loss"] - 0.3


def test_segprop_with_a_persistent_global_head_ends_near_bp_and_above_lw(fashion, bp_curve):
    bp = bp_curve[-1]["accuracy"]
    segprop = segprop_accuracy(fashion, seed=0)
    lw = staged_accuracy(fashion, "lw", seed=0, epochs_per_stage=PASSES // 3, segments=2)
    print(f"fashion accuracy after {PASSES} passes: bp {bp:.3f}  segprop {segprop:.3f}  lw {lw:.3f}")
    # Measured segprop - bp: -0.007 (seeds 0-4: -0.035 .. -0.007).
    assert segprop >= bp - 0.04
    # Measured segprop - lw: +0.083 (seeds 0-4: +0.045 .. +0.084).
    assert segprop >= lw + 0.02


def test_scpl_beats_an_untrained_model_and_ends_near_bp(fashion, bp_curve):
    bp = bp_curve[-1]["accuracy"]
    scpl = learner_curve(fashion, "scpl", seed=0, options=scpl_options(0))
    untrained, final = scpl[0], scpl[-1]
    print(f"fashion scpl: accuracy {untrained['accuracy']:.3f} -> {final['accuracy']:.3f}, "
          f"loss {untrained['loss']:.3f} -> {final['loss']:.3f}; bp {bp:.3f}")
    assert final["accuracy"] >= untrained["accuracy"] + 0.5  # measured 0.090 -> 0.820
    assert final["loss"] <= 0.8  # measured 2.309 -> 0.566 (seeds 0-4: 0.555-0.679)
    assert final["accuracy"] >= bp - 0.04  # measured scpl - bp: 0.000


def test_fgd_learns_real_fashion_mnist(fashion):
    train_x, train_y, test = fashion
    model = build_mlp(MLPConfig(input_shape=(784,), hidden_sizes=(32,), activation="tanh", seed=0))
    learner = edgetrain.Learner(model, method="fgd", optimizer="sgd", lr=3e-3, probe=False, seed=0,
                                method_options={"seed": 0})
    before = learner.evaluate(test)
    for batch in ArrayStream(train_x, train_y, batch_size=32, seed=0, epochs=20):
        learner.step(batch)
    after = learner.evaluate(test)
    print(f"fashion fgd: accuracy {before['accuracy']:.3f} -> {after['accuracy']:.3f}, "
          f"loss {before['loss']:.3f} -> {after['loss']:.3f}")
    # Measured (seeds 0-2): accuracy 0.032 -> 0.635, 0.079 -> 0.618, 0.131 -> 0.630;
    # loss 2.321 -> 1.081, 2.328 -> 1.186, 2.300 -> 1.127.
    assert after["accuracy"] >= 0.50
    assert after["loss"] <= 1.5 and after["loss"] < before["loss"] - 0.7


@pytest.mark.slow
def test_over_three_seeds_segprop_and_scpl_stay_near_bp_on_average(fashion):
    seeds = range(3)
    bp = [learner_curve(fashion, "bp", seed)[-1]["accuracy"] for seed in seeds]
    segprop = [segprop_accuracy(fashion, seed) for seed in seeds]
    scpl = [learner_curve(fashion, "scpl", seed, scpl_options(seed))[-1]["accuracy"] for seed in seeds]
    mean = {name: sum(v) / len(v) for name, v in (("bp", bp), ("segprop", segprop), ("scpl", scpl))}
    print(f"fashion accuracy, seeds 0-2: bp {bp}, segprop {segprop}, scpl {scpl}; means {mean}")
    # Measured means: bp 0.828, segprop 0.811 (-0.017), scpl 0.809 (-0.019).
    assert mean["bp"] >= 0.78
    assert mean["segprop"] >= mean["bp"] - 0.03
    assert mean["scpl"] >= mean["bp"] - 0.04
