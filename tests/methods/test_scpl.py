"""`scpl` and `early_exit`: components from the block view (appendix A.1's splits), projection heads,
gradients that stay inside their component (one loss zeroed at a time, and Eq. (3) written out as
Algorithm 2 does it), inference through the encoders only, two-view augmentation, resuming, zoo models."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import edgetrain
from edgetrain.data.batch import Batch
from edgetrain.methods import METHODS
from edgetrain.methods.base import TrainingError
from edgetrain.methods.scpl import (SCPL, AugmentConfig, EarlyExit, augment_images, make_views, remove_local_heads,
                                    supcon_loss)
from edgetrain.models import load_model
from edgetrain.models.convnet import ConvNetConfig, build_convnet
from edgetrain.models.lstm import LSTMConfig, build_lstm
from edgetrain.models.resnet import ResNetConfig, build_resnet
from edgetrain.models.text_transformer import TextTransformerConfig, build_text_transformer
from edgetrain.models.zoo import example_input, run_blocks
from edgetrain.registry import EdgetrainError

SMALL_HEAD = {"projection_dims": (32, 16)}


# One intra-op thread (tests/conftest.py: fixed reduction order, no OpenMP spinning).
pytestmark = pytest.mark.usefixtures("one_thread")


def digits_like_batch(batch_size: int = 12, index: int = 0, seed: int = 0) -> Batch:
    generator = torch.Generator().manual_seed(seed)
    return Batch(torch.rand(batch_size, 64, generator=generator),
                 torch.arange(batch_size) % 4, index)  # every class at least twice


def small_resnet() -> nn.Module:
    return build_resnet(ResNetConfig(num_classes=4, width=4))


def small_convl() -> nn.Module:
    """ConvL's VGG-style layout (conv + BatchNorm + ReLU + max-pool stages) at toy widths."""
    return build_convnet(ConvNetConfig(input_shape=(3, 16, 16), channels=(4, 6, 8, 8, 8), kernel_size=3, padding=1,
                                       pool=1, batch_norm=True, hidden_sizes=(), num_classes=4, activation="relu"))


# -- components ---------------------------------------------------------------------------------

def test_resnet18_splits_as_appendix_a1():
    method = SCPL(small_resnet(), num_components=4)
    assert method.split == ("embed+blocks.0+blocks.1 | blocks.2+blocks.3 | blocks.4+blocks.5 | "
                            "blocks.6+blocks.7+head")


def test_text_models_give_the_embedding_its_own_component():
    lstm = build_lstm(LSTMConfig(dim=16, num_layers=3, num_classes=4, head_hidden=8))
    method = SCPL(lstm, num_components=4)
    assert method.split == "embed | blocks.0 | blocks.1 | blocks.2+head"
    assert method.num_views == 1
    # Text projection heads are the identity on the mean over positions (A.1): no parameters.
    assert sum(p.numel() for p in lstm.scpl_projections.parameters()) == 0
    tokens = torch.randint(0, 256, (3, 5))
    h = lstm.embed(tokens)
    torch.testing.assert_close(lstm.scpl_projections[0](h), h.mean(dim=1))


def test_vision_projection_heads_are_the_a1_mlp_on_the_flattened_map():
    model = small_convl()
    method = SCPL(model, num_components=4)
    assert method.split == "embed+blocks.0+blocks.1 | blocks.2 | blocks.3 | blocks.4+head"
    for head, channels in zip(model.scpl_projections, (6, 8, 8)):
        linears = [m for m in head.modules() if isinstance(m, nn.Linear)]
        assert [(m.in_features, m.out_features) for m in linears] == [(channels * 16 * 16, 512), (512, 1024)]
        assert any(isinstance(m, nn.ReLU) for m in head.modules())
    assert method.num_views == 2  # images: two augmented views


def test_explicit_split_and_bad_splits():
    model = load_model("convnet-digits")
    assert SCPL(model, split=[2, 1]).split == "embed+blocks.0+blocks.1 | blocks.2+head"
    with pytest.raises(EdgetrainError, match="summing"):
        SCPL(load_model("convnet-digits"), split=[1, 1])
    with pytest.raises(EdgetrainError, match="at least 5 units"):
        SCPL(load_model("convnet-digits"), num_components=5)


def test_refusals():
    with pytest.raises(EdgetrainError, match="classifiers"):
        SCPL(load_model("tiny"))
    lstm = build_lstm(LSTMConfig(dim=8, num_layers=2, num_classes=3))
    with pytest.raises(EdgetrainError, match="views=1"):
        SCPL(lstm, views=2)
    with pytest.raises(EdgetrainError, match="unknown option"):
        METHODS.get("scpl")(load_model("convnet-digits"), temprature=0.2)
    with pytest.raises(EdgetrainError, match="does not apply"):
        METHODS.get("early_exit")(load_model("convnet-digits"), temperature=0.2)


# -- gradients stay local -----------------------------------------------------------------------

def component_grads(method, batch) -> list[dict[str, torch.Tensor]]:
    _, grads = method.gradients(batch)
    return [{name: grads[name] for name in component.params} for component in method.components]


@pytest.mark.parametrize("method_name", ["scpl", "early_exit"])
def test_each_component_is_trained_by_its_own_loss_only(method_name, monkeypatch):
    """Zero component l's loss: l's parameters (its local head included) get no gradient at all and
    every other component's gradient is unchanged -- nothing flows across a boundary either way."""
    model = load_model("convnet-digits")
    options = {"classifier_hidden": 32} if method_name == "early_exit" else SMALL_HEAD
    method = METHODS.get(method_name)(model, **options)
    assert method.num_components == 3
    batch = digits_like_batch()
    full = component_grads(method, batch)
    for grads in full:
        assert any(float(g.abs().max()) > 0 for g in grads.values())
    for zeroed in range(method.num_components):
        component = method.components[zeroed]
        original = component.local_loss
        monkeypatch.setattr(component, "local_loss", lambda out, y, original=original: original(out, y) * 0.0)
        partial = component_grads(method, batch)
        monkeypatch.setattr(component, "local_loss", original)
        for index, grads in enumerate(partial):
            for name, grad in grads.items():
                if index == zeroed:
                    assert float(grad.abs().max()) == 0.0, f"{name} got a gradient from another component's loss"
                else:
                    torch.testing.assert_close(grad, full[index][name], rtol=0, atol=0)


def test_gradients_are_eq3_with_detached_boundaries():
    """Algorithm 2 written out: the sum of the local SupCon losses and the output loss, one backward, a
    detach at every boundary. A run without the detaches gives different gradients upstream (the check
    can fail)."""
    model = load_model("convnet-digits")
    method = SCPL(model, views=1, **SMALL_HEAD)
    batch = digits_like_batch()
    _, grads = method.gradients(batch)
    params = dict(model.named_parameters())

    def algorithm2(detach: bool) -> dict[str, torch.Tensor]:
        for p in params.values():
            p.grad = None
        h = model.embed(batch.inputs)
        h = model.blocks[0](h)
        loss = supcon_loss(model.scpl_projections[0](h), batch.targets, temperature=0.1)
        h = model.blocks[1](h.detach() if detach else h)
        loss = loss + supcon_loss(model.scpl_projections[1](h), batch.targets, temperature=0.1)
        h = model.blocks[2](h.detach() if detach else h)
        loss = loss + F.cross_entropy(model.head(h), batch.targets)
        loss.backward()
        return {n: p.grad.clone() for n, p in params.items()}

    expected = algorithm2(detach=True)
    for name in params:
        torch.testing.assert_close(grads[name], expected[name], rtol=1e-5, atol=1e-7)
    crossing = algorithm2(detach=False)
    assert not torch.allclose(crossing["blocks.0.conv.weight"], expected["blocks.0.conv.weight"])


def test_early_exit_objective_is_a_local_classifier():
    model = load_model("convnet-digits")
    method = EarlyExit(model, views=1, classifier_hidden=16)
    batch = digits_like_batch()
    method.gradients(batch)
    h = model.blocks[0](model.embed(batch.inputs))
    expected = F.cross_entropy(model.early_exit_classifiers[0](h), batch.targets)
    assert method.last_losses[0] == pytest.approx(float(expected.detach()), rel=1e-6)
    assert model.early_exit_classifiers[0][-1].out_features == 10


# -- inference, learner, resuming ---------------------------------------------------------------

def test_inference_uses_only_the_encoders():
    model = load_model("convnet-digits")
    learner = edgetrain.Learner(model, method="scpl", optimizer="adam", lr=1e-3, probe=False, method_options=SMALL_HEAD)
    heads = {n for n, _ in model.named_parameters() if n.startswith("scpl_projections")}
    assert heads and heads <= set(learner.params)  # the optimizer trains the affiliated parameters
    stats = learner.step(digits_like_batch())
    assert stats.loss == learner.method.last_losses[-1]
    x = digits_like_batch(index=1).inputs
    with torch.no_grad():
        torch.testing.assert_close(model(x), run_blocks(model, x))
        before = model(x)
        for p in model.scpl_projections.parameters():
            p.add_(1.0)
        torch.testing.assert_close(model(x), before)
    remove_local_heads(model)
    assert not any(n.startswith("scpl_projections") for n, _ in model.named_parameters())


def train(learner, start: int, stop: int):
    for index in range(start, stop):
        learner.step(digits_like_batch(index=index, seed=index))


@pytest.mark.parametrize("method_name", ["scpl", "early_exit"])
def test_resume_is_exact(method_name, tmp_path):
    options = {"classifier_hidden": 16} if method_name == "early_exit" else SMALL_HEAD

    def new_learner():
        return edgetrain.Learner(load_model("convnet-digits"), method=method_name, optimizer="adam", lr=1e-3,
                                 probe=False, method_options=options)

    straight = new_learner()
    train(straight, 0, 6)
    first = new_learner()
    train(first, 0, 3)
    first.save(tmp_path / "ckpt.safetensors")
    resumed = new_learner().load(tmp_path / "ckpt.safetensors")
    train(resumed, 3, 6)
    for (name, a), b in zip(straight.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name


def test_a_non_finite_local_loss_keeps_the_weights(monkeypatch):
    learner = edgetrain.Learner(load_model("convnet-digits"), method="scpl", lr=1e-2, probe=False,
                                method_options=SMALL_HEAD)
    before = {n: p.detach().clone() for n, p in learner.params.items()}
    component = learner.method.components[1]
    monkeypatch.setattr(component, "local_loss", lambda out, y: out.sum() * float("nan"))
    with pytest.raises(TrainingError, match="component 1"):
        learner.step(digits_like_batch())
    for name, param in learner.params.items():
        assert torch.equal(param, before[name]), name


# -- augmentation -------------------------------------------------------------------------------

def test_views_are_a_function_of_seed_and_batch_index():
    x, y = torch.rand(6, 64), torch.arange(6)
    a, ya = make_views(x, y, num_views=2, image_shape=(1, 8, 8), seed=0, batch_index=3, config=None)
    b, _ = make_views(x, y, num_views=2, image_shape=(1, 8, 8), seed=0, batch_index=3, config=None)
    c, _ = make_views(x, y, num_views=2, image_shape=(1, 8, 8), seed=0, batch_index=4, config=None)
    assert a.shape == (12, 64) and torch.equal(ya, torch.cat([y, y]))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert not torch.equal(a[:6], a[6:])  # the two views differ
    assert float(a.min()) >= 0 and float(a.max()) <= 1


def test_augmentation_without_randomness_is_the_identity():
    images = torch.rand(5, 3, 8, 8)
    still = AugmentConfig(crop_scale=(1.0, 1.0), crop_ratio=(1.0, 1.0), flip=0.0, jitter=0.0, grayscale=0.0)
    torch.testing.assert_close(augment_images(images, torch.Generator().manual_seed(0), still), images)
    flipped = AugmentConfig(crop_scale=(1.0, 1.0), crop_ratio=(1.0, 1.0), flip=1.0, jitter=0.0, grayscale=0.0)
    torch.testing.assert_close(augment_images(images, torch.Generator().manual_seed(0), flipped), images.flip(-1))
    gray = AugmentConfig(crop_scale=(1.0, 1.0), crop_ratio=(1.0, 1.0), flip=0.0, jitter=0.0, grayscale=1.0)
    out = augment_images(images, torch.Generator().manual_seed(0), gray)
    luma = 0.299 * images[:, 0] + 0.587 * images[:, 1] + 0.114 * images[:, 2]
    for channel in range(3):
        torch.testing.assert_close(out[:, channel], luma)


def test_crops_and_jitter_stay_in_range_and_change_images():
    images = torch.rand(16, 3, 12, 12)
    out = augment_images(images, torch.Generator().manual_seed(1), AugmentConfig())
    assert out.shape == images.shape and float(out.min()) >= 0 and float(out.max()) <= 1
    assert (out - images).abs().flatten(1).max(dim=1).values.min() > 0  # every image changed
    with pytest.raises(EdgetrainError, match="unknown setting"):
        SCPL(load_model("convnet-digits"), augment={"rotation": 10})


# -- the zoo ------------------------------------------------------------------------------------

@pytest.mark.parametrize("build, batch_size", [
    (small_convl, 4),
    (small_resnet, 4),
    (lambda: build_lstm(LSTMConfig(dim=16, num_layers=3, num_classes=4, head_hidden=8)), 6),
    (lambda: build_text_transformer(TextTransformerConfig(dim=16, depth=3, num_heads=2, max_len=16, num_classes=4,
                                                          head_hidden=8)), 6),
])
@pytest.mark.parametrize("method_name", ["scpl", "early_exit"])
def test_zoo_models_train(build, batch_size, method_name):
    model = build()
    generator = torch.Generator().manual_seed(0)
    batch = Batch(example_input(model, batch_size, 10, generator=generator), torch.arange(batch_size) % 3, 0)
    options = {"num_components": 4}
    learner = edgetrain.Learner(model, method=method_name, optimizer="adam", lr=1e-3, probe=False,
                                method_options=options)
    before = {n: p.detach().clone() for n, p in learner.params.items()}
    learner.step(batch)
    assert all(torch.isfinite(torch.tensor(learner.method.last_losses)))
    assert len(learner.method.last_losses) == 4
    moved = [n for n, p in learner.params.items() if not torch.equal(p, before[n])]
    for component in learner.method.components:  # every component learned something
        assert any(name in moved for name in component.params), component.name
