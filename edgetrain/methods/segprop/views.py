"""The units a staged schedule cuts: the model's block view, or a finer view for one architecture.

"blocks" (every model): embed, one unit per block, the model's head.

"resnet-paper" (ResNets with BasicBlocks): as "blocks", except that the last BasicBlock is cut in
two, as in SegProp's appendix B.2 for ResNet-18: its front (conv1 + norm + ReLU, and the shortcut)
produces the pair (I, P) = (identity branch, input of the last conv); its back (conv2 + norm, plus
I, ReLU) is the first unit of the global head. With head_blocks=1 and segments=4 on ResNet-18 this
is the paper's split exactly: stem + layer1 | layer2 | layer3 | layer4[0] + layer4[1].front, global
head = layer4[1].back (last conv + BN) + the classifier.

Units only reference the model's own submodules: the model keeps its structure and its plain
forward, which equals running the units in order (`view.forward`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

import torch
from torch import nn

from edgetrain.registry import EdgetrainError

VIEWS = ("auto", "blocks", "resnet-paper")

# The shape of a state between units: one tensor, or a tuple of tensors (ResNet's (I, P) pair).
Spec = Union[torch.Size, tuple[torch.Size, ...]]


@dataclass
class UnitView:
    embed: nn.Module
    units: list[nn.Module]
    head: nn.Module
    names: list[str]

    def __len__(self) -> int:
        return len(self.units)

    def run(self, state: Any, start: int, end: int) -> Any:
        for unit in self.units[start:end]:
            state = unit(state)
        return state

    def forward(self, x: Any) -> Any:
        return self.head(self.run(self.embed(x), 0, len(self.units)))


class BasicBlockFront(nn.Module):
    """h -> (I, P): the shortcut of h and relu(norm1(conv1(h)))."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.conv1, self.norm1, self.shortcut = block.conv1, block.norm1, block.shortcut
        self.act = nn.ReLU()

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.shortcut(h), self.act(self.norm1(self.conv1(h)))


class BasicBlockBack(nn.Module):
    """(I, P) -> relu(norm2(conv2(P)) + I): the rest of the block."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.conv2, self.norm2 = block.conv2, block.norm2
        self.act = nn.ReLU()

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        identity, pre = pair
        return self.act(self.norm2(self.conv2(pre)) + identity)


def _is_basic_block(block: nn.Module) -> bool:
    return all(hasattr(block, name) for name in ("conv1", "norm1", "conv2", "norm2", "shortcut"))


def unit_view(model: nn.Module, view: str = "auto") -> UnitView:
    for name in ("embed", "blocks", "head"):
        if not isinstance(getattr(model, name, None), nn.Module):
            raise EdgetrainError(f"{type(model).__name__} has no block view (model.{name} is missing); "
                                 "staged training needs embed / blocks / head")
    if view not in VIEWS:
        raise EdgetrainError(f"unknown view {view!r}; known views: {', '.join(VIEWS)}")
    blocks = list(model.blocks)
    names = [f"blocks.{i}" for i in range(len(blocks))]
    if view in ("auto", "blocks"):
        return UnitView(model.embed, blocks, model.head, names)
    last = blocks[-1]
    if not _is_basic_block(last):
        raise EdgetrainError(f"view 'resnet-paper' needs a ResNet whose last block is a BasicBlock; "
                             f"{type(model).__name__}'s last block is a {type(last).__name__}")
    front, back = BasicBlockFront(last), BasicBlockBack(last)
    last_name = names[-1]
    return UnitView(model.embed, blocks[:-1] + [front, back], model.head,
                    names[:-1] + [f"{last_name}.front", f"{last_name}.back"])


def state_spec(state: Any) -> Spec:
    if isinstance(state, torch.Tensor):
        return state.shape
    if isinstance(state, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in state):
        return tuple(t.shape for t in state)
    raise EdgetrainError(f"a unit returned a {type(state).__name__}; staged training handles tensors and "
                         "tuples of tensors between units")


def model_device_dtype(model: nn.Module) -> tuple[torch.device, torch.dtype]:
    """Device and dtype of the model's first floating-point parameter (CPU float32 when it has none)."""
    for param in model.parameters():
        if param.is_floating_point():
            return param.device, param.dtype
    return torch.device("cpu"), torch.float32


def probe_input(model: nn.Module, example: Any, device: torch.device, dtype: torch.dtype) -> Any:
    """The input the probes below run on: `example`, or edgetrain.models.zoo.example_input(model, 2, 8)
    when None; a tensor goes to `device`, a floating-point one also to `dtype`."""
    if example is None:
        from edgetrain.models.zoo import example_input as zoo_example

        example = zoo_example(model, 2, 8)
    if isinstance(example, torch.Tensor):
        # Features and images in the model's dtype: a float64 or bf16 model refuses float32 inputs.
        example = example.to(device, dtype=dtype if example.is_floating_point() else None)
    return example


@torch.no_grad()
def probe_specs(view: UnitView, example: Any) -> tuple[list[Spec], torch.Size]:
    """The shape of the state after the embedding (index 0) and after every unit (index i + 1), and of
    the head's output, from one forward of `example` in eval mode (no BatchNorm statistics change, no
    autograd)."""
    modules = [view.embed, *view.units, view.head]
    modes = [(m, m.training) for module in modules for m in module.modules()]
    try:
        for module in modules:
            nn.Module.train(module, False)
        state = view.embed(example)
        specs = [state_spec(state)]
        for unit in view.units:
            state = unit(state)
            specs.append(state_spec(state))
        output = view.head(state)
    finally:
        for m, mode in modes:
            m.training = mode
    return specs, output.shape


def batch_free(spec: Spec) -> tuple:
    """The spec without its batch dimension (what adapters must match)."""
    if isinstance(spec, torch.Size):
        return tuple(spec[1:])
    return tuple(tuple(s[1:]) for s in spec)


def _leaves(state: Any) -> list[torch.Tensor]:
    return [state] if isinstance(state, torch.Tensor) else list(state)


def _fresh_leaf(state: Any) -> Any:
    """`state` detached, its float tensors requiring grad (so the next unit saves for backward)."""
    leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in _leaves(state)]
    return leaves[0] if isinstance(state, torch.Tensor) else tuple(leaves)


def probe_activation_bytes(view: UnitView, example: Any) -> list[tuple[int, int]]:
    """(bytes saved for backward, largest saved tensor) of each part on `example`: [embedding, unit 0,
    unit 1, ...] (parameters excluded; in eval mode, so no statistics change). What balance="memory"
    evens out: a stage keeps the saved bytes of its active units, and its backward briefly holds
    gradients the size of its largest activation."""
    modules = [view.embed, *view.units, view.head]
    weights = {p.untyped_storage().data_ptr() for m in modules for p in m.parameters()}
    modes = [(m, m.training) for module in modules for m in module.modules()]
    costs: list[tuple[int, int]] = []

    def run(fn: Any, state: Any) -> Any:
        seen: set[int] = set()
        total, largest = [0], [0]

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key not in weights and key not in seen:
                seen.add(key)
                total[0] += storage.nbytes()
                largest[0] = max(largest[0], storage.nbytes())
            return t

        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fn(state)
        costs.append((total[0], largest[0]))
        return out

    try:
        for module in modules:
            nn.Module.train(module, False)
        # A copy: a view of a larger batch would be charged its whole storage.
        example = example.detach().clone() if isinstance(example, torch.Tensor) else example
        state = run(view.embed, _fresh_leaf(example) if torch.is_floating_point(example) else example)
        for unit in view.units:
            state = run(unit, _fresh_leaf(state))
    finally:
        for m, mode in modes:
            m.training = mode
    return costs
