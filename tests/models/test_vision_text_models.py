"""Vision and text model zoo: every preset through the same block-view checks, then one test per
architecture of what would be wrong if it were built wrong (shapes, counts, layers, fallbacks)."""
from __future__ import annotations

from typing import Callable

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch import nn
from torch.func import functional_call

import edgetrain.models.convnet  # noqa: F401  (importing a model module registers its presets)
import edgetrain.models.lstm  # noqa: F401
import edgetrain.models.mlp  # noqa: F401
import edgetrain.models.mobilenet  # noqa: F401
import edgetrain.models.resnet  # noqa: F401
import edgetrain.models.text_transformer  # noqa: F401
import edgetrain.models.vit  # noqa: F401
from edgetrain.models.convnet import ConvNetConfig, build_convnet
from edgetrain.models.llama import ConfigError
from edgetrain.models.lstm import LSTMBlock, LSTMConfig, build_lstm
from edgetrain.models.mlp import MLPConfig
from edgetrain.models.mobilenet import InvertedResidual, SqueezeExcite
from edgetrain.models.resnet import ResNetConfig, build_resnet
from edgetrain.models.text_transformer import TextTransformerConfig, build_text_transformer
from edgetrain.models.vit import ViTConfig, attention
from edgetrain.models.zoo import MODEL_PRESETS, run_blocks
from edgetrain.registry import EdgetrainError
from edgetrain.training.losses import task_loss

BATCH = 2


def images(channels: int, size: int) -> Callable[[int], torch.Tensor]:
    return lambda batch: torch.randn(batch, channels, size, size, generator=torch.Generator().manual_seed(1))


def flat(features: int) -> Callable[[int], torch.Tensor]:
    return lambda batch: torch.randn(batch, features, generator=torch.Generator().manual_seed(1))


def tokens(seq_len: int) -> Callable[[int], torch.Tensor]:
    return lambda batch: torch.randint(0, 256, (batch, seq_len), generator=torch.Generator().manual_seed(1))


# (preset, input builder, number of classes). Every preset of these modules is here but the bare paper
# names (`fcs` is `fcs-tanh`, see test_bare_paper_names_are_the_tanh_variants); the ImageNet-sized ones
# run on 64x64 images (both pool globally, so any size >= 32 is a valid input).
CASES = [
    ("fcs-tanh", images(1, 28), 10), ("fcs-relu", images(1, 28), 10),
    ("fcs-tanh-cifar", images(3, 32), 10), ("fcs-relu-cifar", images(3, 32), 10),
    ("fcl-tanh", images(1, 28), 10), ("fcl-relu", images(1, 28), 10),
    ("fcl-tanh-cifar", images(3, 32), 10), ("fcl-relu-cifar", images(3, 32), 10),
    ("mlp-digits", flat(64), 10),
    ("convs-tanh", images(1, 28), 10), ("convs-relu", images(1, 28), 10),
    ("convs-tanh-cifar", images(3, 32), 10), ("convs-relu-cifar", images(3, 32), 10),
    ("convl-tanh", images(1, 28), 10), ("convl-relu", images(1, 28), 10),
    ("convl-tanh-cifar", images(3, 32), 10), ("convl-relu-cifar", images(3, 32), 10),
    ("convnet-digits", images(1, 8), 10),
    ("resnet18-cifar", images(3, 32), 10), ("resnet18-cifar-gn", images(3, 32), 10),
    ("resnet18-imagenet", images(3, 64), 1000),
    ("mobilenetv3-small-cifar", images(3, 32), 10), ("mobilenetv3-small", images(3, 64), 1000),
    ("vit-tiny-cifar", images(3, 32), 10),
    ("lstm-text", tokens(16), 4), ("transformer-text", tokens(16), 4),
]
IDS = [case[0] for case in CASES]


@pytest.fixture(scope="module")
def built() -> dict[str, nn.Module]:
    """One model per preset, built once; tests that train take a fresh copy instead."""
    return {name: MODEL_PRESETS.get(name)() for name, _, _ in CASES}


def loss_of(model: nn.Module, x: torch.Tensor, logits: torch.Tensor | None = None) -> torch.Tensor:
    logits = model(x) if logits is None else logits
    targets = torch.arange(logits.shape[0]) % logits.shape[1]
    return task_loss(model, logits, targets)


@pytest.mark.parametrize("name, make_input, classes", CASES, ids=IDS)
def test_block_view_and_output_shape(built, name, make_input, classes):
    model = built[name]
    assert model.task == "classify"
    assert isinstance(model.blocks, nn.ModuleList) and len(model.blocks) > 0
    x = make_input(BATCH)
    torch.manual_seed(0)  # MobileNet's dropout: the same mask on both sides
    out = model(x)
    torch.manual_seed(0)
    assert torch.equal(out, run_blocks(model, x))
    assert out.shape == (BATCH, classes) and out.dtype == torch.float32
    h = model.embed(x)
    for index, block in enumerate(model.blocks):
        h = block(h)
        assert isinstance(h, torch.Tensor) and h.shape[0] == BATCH, f"block {index}"
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("name, make_input, classes", CASES, ids=IDS)
def test_gradients_reach_every_parameter(built, name, make_input, classes):
    model = built[name]
    model.zero_grad(set_to_none=True)
    # Batch 4: with 2 samples BatchNorm maps every feature to +-1, and nothing before it gets a gradient.
    loss_of(model, make_input(4)).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    model.zero_grad(set_to_none=True)
    assert not missing, f"no gradient reached {missing}"


@pytest.mark.parametrize("name, make_input, classes", CASES, ids=IDS)
def test_sgd_lowers_the_loss_on_a_fixed_batch(name, make_input, classes):
    model = MODEL_PRESETS.get(name)()
    x = make_input(4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.002)
    losses = []
    for _ in range(4):
        torch.manual_seed(0)
        loss = loss_of(model, x)
        losses.append(loss.item())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert all(after < before for before, after in zip(losses, losses[1:])), losses


# torch loads its forward-AD decompositions with torch.jit.script on first use, which warns.
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("name, make_input, classes", CASES, ids=IDS)
def test_forward_mode_jvp_matches_backprop(built, name, make_input, classes):
    """Forward gradients need forward-mode AD through every layer (the fused attention and LSTM
    kernels lack it; the models fall back). Dual tensors, not torch.func.jvp, because BatchNorm
    updates its running statistics in place."""
    model = built[name]
    x = make_input(BATCH)
    params = {n: p.detach() for n, p in model.named_parameters()}
    generator = torch.Generator().manual_seed(2)
    tangents = {n: torch.randn(p.shape, generator=generator) for n, p in params.items()}
    buffers = dict(model.named_buffers())
    with fwAD.dual_level():
        duals = {n: fwAD.make_dual(p, tangents[n]) for n, p in params.items()}
        torch.manual_seed(0)
        loss = loss_of(model, x, logits=functional_call(model, {**duals, **buffers}, (x,)))
        directional = fwAD.unpack_dual(loss).tangent
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    loss_of(model, x).backward()
    expected = sum((p.grad * tangents[n]).sum() for n, p in model.named_parameters())
    model.zero_grad(set_to_none=True)
    assert torch.allclose(directional, expected, rtol=1e-3, atol=1e-5), (directional, expected)


def test_presets_are_reproducible_and_leave_the_global_rng_alone():
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    first = MODEL_PRESETS.get("mlp-digits")()
    assert torch.equal(torch.rand(1), expected_next)
    second = MODEL_PRESETS.get("mlp-digits")()
    for a, b in zip(first.parameters(), second.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("family", ["fcs", "fcl", "convs", "convl"])
def test_bare_paper_names_are_the_tanh_variants(family):
    bare, tanh = MODEL_PRESETS.get(family)(), MODEL_PRESETS.get(f"{family}-tanh")()
    assert repr(bare) == repr(tanh)
    assert all(torch.equal(a, b) for a, b in zip(bare.state_dict().values(), tanh.state_dict().values()))


def _count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _of_type(model: nn.Module, kind: type) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, kind)]


# --- MLP ---------------------------------------------------------------------------------------

def test_fcs_and_fcl_follow_the_asyncfgd_tables(built):
    fcs = built["fcs-tanh"]
    assert [b.linear.out_features for b in fcs.blocks] == [1024, 512, 256]
    assert fcs.blocks[0].linear.in_features == 28 * 28 and fcs.head.out_features == 10
    assert not _of_type(fcs, nn.BatchNorm1d) and len(_of_type(fcs, nn.Tanh)) == 3
    fcl = built["fcl-relu-cifar"]
    assert [b.linear.out_features for b in fcl.blocks] == [1024, 1024, 1024, 1024, 512]
    assert fcl.blocks[0].linear.in_features == 3 * 32 * 32 and fcl.head.in_features == 512
    assert len(_of_type(fcl, nn.BatchNorm1d)) == 5 and len(_of_type(fcl, nn.ReLU)) == 5
    assert not _of_type(fcl, nn.Tanh)


def test_mlp_digits_is_64_32_10_tanh(built):
    model = built["mlp-digits"]
    assert _count(model) == 64 * 32 + 32 + 32 * 10 + 10
    assert isinstance(model.blocks[0].act, nn.Tanh)
    x = flat(64)(BATCH)  # flat rows and 8x8 images are the same input
    assert torch.equal(model(x), model(x.view(BATCH, 1, 8, 8)))


def test_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="activation"):
        MLPConfig(activation="gelu")
    with pytest.raises(ConfigError, match="hidden_sizes"):
        MLPConfig(hidden_sizes=(32, 0))
    with pytest.raises(ConfigError, match="num_groups"):
        ResNetConfig(norm="group", num_groups=3)
    with pytest.raises(ConfigError, match="patch_size"):
        ViTConfig(image_size=32, patch_size=5)
    with pytest.raises(ConfigError, match="shrinks"):
        ConvNetConfig(input_shape=(1, 8, 8), channels=(8, 8, 8, 8), kernel_size=3, padding=1)


# --- ConvNet -----------------------------------------------------------------------------------

def test_convs_matches_table_8(built):
    model = built["convs-tanh"]
    conv = model.blocks[0].conv
    assert (conv.out_channels, conv.kernel_size, conv.padding) == (32, (5, 5), (2, 2))
    assert model.blocks[1].layer.linear.in_features == 32 * 14 * 14
    assert model.blocks[1].layer.linear.out_features == 1000
    # conv 1*32*25+32, fc1 6272*1000+1000, fc2 1000*10+10
    assert _count(model) == 832 + 6_273_000 + 10_010


def test_convl_matches_table_11_for_both_datasets(built):
    for name in ("convl-relu", "convl-tanh-cifar"):
        model = built[name]
        assert [b.conv.out_channels for b in model.blocks] == [32, 64, 128, 256, 512]
        assert all(b.conv.padding == (2, 2) and b.conv.kernel_size == (3, 3) for b in model.blocks)
        assert len(_of_type(model, nn.BatchNorm2d)) == 5
        # padding 2 grows each 3x3 conv's map by 2: 28 -> 30/15 -> 17/8 -> 10/5 -> 7/3 -> 5/2 (32 ends at 2 too)
        assert model.head[1].in_features == 512 * 2 * 2


def test_convnet_takes_flat_digits_and_refuses_wrong_sizes(built):
    model = built["convnet-digits"]
    x = images(1, 8)(BATCH)
    assert torch.equal(model(x), model(x.reshape(BATCH, 64)))
    with pytest.raises(EdgetrainError, match="1, 8, 8"):
        model(torch.randn(BATCH, 1, 28, 28))
    custom = build_convnet(ConvNetConfig(input_shape=(3, 16, 16), channels=(4,), hidden_sizes=(), num_classes=3))
    assert custom(torch.randn(BATCH, 3, 16, 16)).shape == (BATCH, 3)


# --- ResNet ------------------------------------------------------------------------------------

def test_resnet18_parameter_counts_match_the_references(built):
    assert _count(built["resnet18-cifar"]) == 11_173_962
    assert _count(built["resnet18-imagenet"]) == 11_689_512  # torchvision resnet18
    assert len(built["resnet18-cifar"].blocks) == 8


def test_resnet_stems_set_the_resolution(built):
    x = images(3, 32)(BATCH)
    cifar = built["resnet18-cifar"]
    assert cifar.embed(x).shape == (BATCH, 64, 32, 32)
    assert run_blocks_until_head(cifar, x).shape == (BATCH, 512, 4, 4)
    imagenet = built["resnet18-imagenet"]
    assert imagenet.embed(images(3, 64)(BATCH)).shape == (BATCH, 64, 16, 16)
    assert isinstance(imagenet.embed.pool, nn.MaxPool2d) and imagenet.embed.conv.kernel_size == (7, 7)


def run_blocks_until_head(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    h = model.embed(x)
    for block in model.blocks:
        h = block(h)
    return h


def test_group_norm_resnet_has_no_batch_norm(built):
    model = built["resnet18-cifar-gn"]
    assert not _of_type(model, nn.BatchNorm2d) and not list(model.buffers())
    norms = _of_type(model, nn.GroupNorm)
    assert norms and all(n.num_groups == 2 for n in norms)
    four = build_resnet(ResNetConfig(norm="group", num_groups=4, width=8))
    assert all(n.num_groups == 4 for n in _of_type(four, nn.GroupNorm))


# --- MobileNetV3 -------------------------------------------------------------------------------

def test_mobilenetv3_small_has_se_hardswish_and_reference_size(built):
    model = built["mobilenetv3-small"]
    assert _count(model) == 2_542_856  # torchvision mobilenet_v3_small
    assert len(model.blocks) == 11 and all(isinstance(b, InvertedResidual) for b in model.blocks)
    assert len(_of_type(model, SqueezeExcite)) == 9
    assert _of_type(model, nn.Hardswish) and _of_type(model, nn.Hardsigmoid)
    assert sum(b.residual for b in model.blocks) == 6
    cifar = built["mobilenetv3-small-cifar"]
    assert run_blocks_until_head(cifar, images(3, 32)(BATCH)).shape == (BATCH, 96, 2, 2)


# --- ViT ---------------------------------------------------------------------------------------

def test_vit_tokens_are_class_token_plus_patches(built):
    model = built["vit-tiny-cifar"]
    h = model.embed(images(3, 32)(BATCH))
    assert h.shape == (BATCH, 1 + 8 * 8, 192)
    assert len(model.blocks) == 6 and model.blocks[0].attn.num_heads == 3
    with pytest.raises(EdgetrainError, match="32x32"):
        model(torch.randn(BATCH, 3, 28, 28))


# --- LSTM --------------------------------------------------------------------------------------

@pytest.mark.parametrize("bidirectional", [False, True])
def test_lstm_unrolled_path_equals_the_fused_kernel(bidirectional):
    model = build_lstm(LSTMConfig(dim=16, num_layers=2, bidirectional=bidirectional))
    x = tokens(7)(BATCH)
    fused = model(x)
    for block in model.blocks:
        block.force_unrolled = True  # instance attribute: other models keep the fused path
    assert torch.allclose(model(x), fused, atol=1e-6)
    assert not LSTMBlock.force_unrolled


def test_lstm_text_preset_shape(built):
    model = built["lstm-text"]
    assert model.embed.num_embeddings == 256 and model.embed.embedding_dim == 128
    assert all(b.lstm.hidden_size == 128 and b.lstm.num_layers == 1 for b in model.blocks)
    assert len(model.blocks) == 2 and model.head.fc.out_features == 4


# --- Text transformer ----------------------------------------------------------------------------

def test_text_transformer_uses_positions_and_refuses_long_inputs(built):
    model = built["transformer-text"]
    x = tokens(16)(BATCH)
    swapped = x.clone()
    swapped[:, [0, 1]] = x[:, [1, 0]]
    assert not torch.allclose(model(x), model(swapped))  # without positions attention is order-blind
    with pytest.raises(EdgetrainError, match="max_len"):
        model(tokens(513)(1))
    two_layer_head = build_text_transformer(TextTransformerConfig(dim=16, num_heads=2, head_hidden=8))
    assert isinstance(two_layer_head.head.fc[1], nn.Tanh)


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_attention_falls_back_under_forward_mode_ad():
    q, k, v = (torch.randn(2, 3, 5, 8, generator=torch.Generator().manual_seed(s)) for s in range(3))
    fused = attention(q, k, v)
    with fwAD.dual_level():
        out = attention(fwAD.make_dual(q, torch.ones_like(q)), k, v)
        primal, tangent = fwAD.unpack_dual(out)
    assert torch.allclose(primal, fused, atol=1e-6) and tangent is not None
