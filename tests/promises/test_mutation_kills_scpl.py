"""Promises of SCPL that mutation testing found unguarded (tools/mutation scpl, docs/mutation.md): each
test here kills a mutant of edgetrain/methods/scpl/method.py that every other test let survive. Named
after the promise, not the mutant."""
from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import edgetrain
from edgetrain.data.batch import Batch
from edgetrain.methods import METHODS
from edgetrain.methods.scpl import SCPL, EarlyExit, LocalLearning, make_views
from edgetrain.models import load_model
from edgetrain.models.convnet import ConvNetConfig, build_convnet
from edgetrain.models.lstm import LSTMConfig, build_lstm
from edgetrain.models.resnet import ResNetConfig, build_resnet
from edgetrain.registry import EdgetrainError
from float64_mlp import feature_batches, mlp_float64

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL_HEAD = {"projection_dims": (8, 4)}


def three_components() -> nn.Module:
    """The float64 Tanh MLP cut into embed+blocks.0 | blocks.1 | blocks.2+head (flat features: one view)."""
    return mlp_float64((6, 5, 7))


def image_batch(shape: tuple[int, ...], index: int = 0, size: int = 6) -> Batch:
    generator = torch.Generator().manual_seed(index)
    return Batch(torch.rand(size, *shape, generator=generator), torch.arange(size) % 3, index)


# -- options ------------------------------------------------------------------------------------------

def test_scpl_and_early_exit_defaults_are_the_documented_ones():
    # The module docstring gives seed 0 and an early-exit classifier 512 wide: a run with the defaults
    # (its heads, its augmented views, the seed its checkpoints carry) is only the same run across
    # versions if they stay.
    method = SCPL(three_components(), **SMALL_HEAD)
    assert method.seed == 0 and method.state_dict() == {"seed": 0}
    model = load_model("convnet-digits")
    EarlyExit(model)
    widths = [[m.out_features for m in head if isinstance(m, nn.Linear)][0] for head in model.early_exit_classifiers]
    assert widths and all(width == 512 for width in widths)


@pytest.mark.parametrize("seed", [True, 1.5, "0"])
def test_a_seed_that_is_not_an_integer_is_refused(seed):
    # torch would quietly turn True into 1, round 1.5 and parse "0": the seed picks the heads and every
    # augmented view, so a silently converted one is a run the user did not ask for.
    with pytest.raises(EdgetrainError, match="seed must be an integer"):
        SCPL(mlp_float64(), seed=seed, **SMALL_HEAD)


@pytest.mark.parametrize("views", [0, -1, True, 2.0, "two"])
def test_views_must_be_auto_or_a_positive_integer(views):
    # Zero views is an empty batch; True, 2.0 or "two" would be taken as a count (or fail later, in
    # the middle of a step, with a bare Python error) -- refuse them when the learner is built.
    with pytest.raises(EdgetrainError, match="views must be 'auto' or a positive integer"):
        SCPL(load_model("convnet-digits"), views=views, **SMALL_HEAD)


def test_refusing_two_views_names_what_the_model_takes():
    # The refusal tells the user why: augmentations need images, and this model takes token ids (or
    # flat features). A message that names the wrong kind of input sends them looking elsewhere.
    with pytest.raises(EdgetrainError, match="takes token ids"):
        SCPL(build_lstm(LSTMConfig(dim=8, num_layers=2, num_classes=3)), views=2)
    with pytest.raises(EdgetrainError, match="takes flat features"):
        SCPL(mlp_float64(), views=2, **SMALL_HEAD)


def test_local_learning_takes_its_arguments_by_keyword():
    # LocalLearning is the exported base of scpl and early_exit (edgetrain.methods.scpl): a method built
    # on it may name its arguments, and the options are keyword-only so that none lands in a wrong slot.
    model = mlp_float64()
    method = LocalLearning(name="mine", objective="supcon", model=model, **SMALL_HEAD)
    assert method.name == "mine" and method.num_components == 2
    with pytest.raises(TypeError):
        LocalLearning("mine", "supcon", model, 2)  # type: ignore[misc]


# -- the input shape and the views --------------------------------------------------------------------

@dataclass
class ClassesOnlyConfig:
    """A model config that names the classes and nothing about the inputs."""
    num_classes: int = 3


@dataclass
class OptionalShapeConfig:
    """A model config whose input shape is optional and not given."""
    num_classes: int = 3
    input_shape: tuple[int, ...] | None = None


def convnet_with_config(config) -> nn.Module:
    """A small ConvNet on 1x8x8 images (flat [B, 64] inputs fit too), its config replaced by one that
    does not give the input shape."""
    model = build_convnet(ConvNetConfig(input_shape=(1, 8, 8), channels=(4, 4), kernel_size=3, padding=1, pool=2,
                                        hidden_sizes=(8,), num_classes=3, activation="tanh"))
    model.config = config
    return model


@pytest.mark.parametrize("config", [ClassesOnlyConfig(), OptionalShapeConfig()], ids=["no-shape", "shape-none"])
def test_example_inputs_give_the_image_shape_a_config_does_not(config):
    # The documented way in for a model whose config does not give its input shape: the example batch
    # says the inputs are 1x8x8 images, so a step trains on two augmented views of each (flat) sample.
    method = SCPL(convnet_with_config(config), example_inputs=torch.rand(2, 1, 8, 8), **SMALL_HEAD)
    assert method.num_views == 2
    batch = image_batch((64,), index=5)
    inputs, targets = method.batch_views(batch)
    expected, expected_targets = make_views(batch.inputs, batch.targets, num_views=2, image_shape=(1, 8, 8), seed=0,
                                            batch_index=5, config=None)
    assert torch.equal(inputs, expected) and torch.equal(targets, expected_targets)
    method.gradients(batch)
    assert len(method.last_losses) == 3 and all(math.isfinite(loss) for loss in method.last_losses)


def test_flat_example_inputs_mean_one_view():
    # Feature vectors cannot be cropped or flipped: an example batch of them must not make the method
    # treat each vector as an image (with views=auto that is one view, the batch as it is).
    method = SCPL(mlp_float64(), example_inputs=torch.randn(2, 8, dtype=torch.float64), **SMALL_HEAD)
    assert method.num_views == 1
    batch = feature_batches(1)[0]
    inputs, targets = method.batch_views(batch)
    assert torch.equal(inputs, batch.inputs) and torch.equal(targets, batch.targets)


def test_image_batches_are_augmented_at_their_own_size():
    # A ResNet is fully convolutional and identity projections fix no feature size, so it trains on
    # images of any size: a batch of 16x16 images is cropped and resized as 16x16 images, whatever
    # size the config's default input (32x32 for the CIFAR stem) assumes.
    model = build_resnet(ResNetConfig(num_classes=3, width=4, blocks_per_stage=(1, 1)))
    method = SCPL(model, num_components=2, projection="identity")
    assert method.num_views == 2
    batch = image_batch((3, 16, 16), index=2)
    inputs, _ = method.batch_views(batch)
    expected, _ = make_views(batch.inputs, batch.targets, num_views=2, image_shape=(3, 16, 16), seed=0, batch_index=2,
                             config=None)
    assert torch.equal(inputs, expected)
    method.gradients(batch)
    assert len(method.last_losses) == 2 and all(math.isfinite(loss) for loss in method.last_losses)


# -- what gradients() and step() return and leave ----------------------------------------------------

def test_gradients_returns_the_task_loss_of_the_last_component():
    # The documented return value: the loss a caller logs for an scpl model is the task loss of the
    # model's output, not the contrastive loss of an inner component. One view of flat features: the
    # last component's output is the model's own forward.
    model = three_components()
    learner = edgetrain.Learner(model, method="scpl", probe=False, method_options=SMALL_HEAD)
    batch = feature_batches(1)[0]
    loss, _ = learner.compute_gradients(batch)
    with torch.no_grad():
        expected = float(F.cross_entropy(model(batch.inputs), batch.targets))
    assert len(learner.method.last_losses) == 3
    assert all(abs(other - expected) > 1e-3 for other in learner.method.last_losses[:-1])  # the check can fail
    assert loss == pytest.approx(expected, rel=1e-6)


def test_gradients_are_this_batch_gradient_whatever_grad_held():
    # .grad left over from the caller's own backward (say) must not be added to the gradient returned.
    model, batch = three_components(), feature_batches(1)[0]
    learner = edgetrain.Learner(model, method="scpl", probe=False, method_options=SMALL_HEAD)
    _, expected = learner.compute_gradients(batch)
    for param in learner.params.values():
        param.grad = torch.ones_like(param)
    _, grads = learner.compute_gradients(batch)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name], rtol=0, atol=0, msg=name)


def test_a_step_does_not_depend_on_what_grad_held():
    # A step is a function of the weights, the optimizer state and the batch, not of .grad left over
    # from the caller's own backward. Parameters the step does not train -- early_exit's classifiers,
    # left on the model by an earlier early_exit run -- get no gradient, so weight decay passes them by.
    batch = feature_batches(1)[0]
    weights = []
    for stale in (False, True):
        model = three_components()
        EarlyExit(model, classifier_hidden=4)
        learner = edgetrain.Learner(model, method="scpl", optimizer="sgd", lr=0.1, probe=False,
                                    optimizer_options={"weight_decay": 0.1}, method_options=SMALL_HEAD)
        if stale:
            for param in learner.params.values():
                param.grad = torch.ones_like(param)
        learner.step(batch)
        weights.append({name: p.detach().clone() for name, p in model.named_parameters()})
    clean, after_stale = weights
    assert any(name.startswith("early_exit_classifiers") for name in clean)
    for name, value in clean.items():
        assert torch.equal(after_stale[name], value), name


def test_scpl_keeps_no_gradient_buffers_between_steps():
    # Between steps only the weights (and optimizer state) are held: the memory budget counts weights
    # plus the step's measured peak, not a gradient per parameter left over.
    learner = edgetrain.Learner(three_components(), method="scpl", optimizer="sgd", lr=0.1, probe=False,
                                method_options=SMALL_HEAD)
    learner.step(feature_batches(1)[0])
    assert all(param.grad is None for param in learner.params.values())


def test_scpl_steps_hold_no_copy_of_the_weights(monkeypatch):
    # SCPL changes no weight before every local loss is known finite (one optimizer step, at the end),
    # so the learner needs no snapshot of the weights and optimizer state to undo a failed step -- a
    # copy that would be held through every step, on a device another model's worth of memory (three
    # with Adam) that the memory budget does not count.
    learner = edgetrain.Learner(three_components(), method="scpl", optimizer="adam", lr=1e-3, probe=False,
                                method_options=SMALL_HEAD)
    taken = []
    snapshot = learner.snapshot
    monkeypatch.setattr(learner, "snapshot", lambda: taken.append(1) or snapshot())
    for batch in feature_batches(2):
        learner.step(batch)
    assert taken == []


def test_a_trainable_parameter_no_component_owns_is_refused():
    # Found by mutation triage: a scale applied before the head, outside embed/blocks/head, was accepted
    # and never trained, so SCPL optimised a function other than model(x). (Early Exit builds its
    # components with the same function.)
    class ScaledHead(nn.Module):
        task = "classify"

        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.embed = nn.Linear(4, 5)
            self.blocks = nn.ModuleList([nn.Linear(5, 5), nn.Linear(5, 5)])
            self.head = nn.Linear(5, 3)
            self.scale = nn.Parameter(torch.tensor(1.3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(self.embed(x))
            for block in self.blocks:
                h = torch.tanh(block(h))
            return self.head(h * self.scale)

    options = {"example_inputs": torch.randn(2, 4), "projection_dims": (4, 4)}
    with pytest.raises(EdgetrainError, match=r"ScaledHead: trainable parameters outside the components \(scale\)"):
        METHODS.get("scpl")(ScaledHead(), **options)
    frozen = ScaledHead()
    frozen.scale.requires_grad_(False)
    assert "scale" not in METHODS.get("scpl")(frozen, **options).params
