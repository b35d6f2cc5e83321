"""Cutting a classifier's block view into SCPL components, each with its local objective.

Units. The block view gives embed, blocks.0 .. blocks.N-1, head. The embed is a unit of its own when
it has trainable weights (a token embedding, a ResNet stem) and joins blocks.0 when it has none (a
ConvNet's reshape); the head always joins the last component. Components take contiguous units,
spread as evenly as the count allows with the extra ones going first: ResNet-18's stem + 8 blocks in
4 components is appendix A.1's [stem + 2 blocks] [2] [2] [2 + FC]; a 3-layer LSTM classifier's
embedding + 3 layers in 4 is its [embedding] [LSTM] [LSTM] [LSTM + classifier]. `split` gives the
unit counts explicitly.

Local objectives. Component l < L maps r_{l-1} (detached) to r_l = f_l(r_{l-1}) and is trained by
  scpl        the supervised contrastive loss of z_l = g_l(r_l), g_l a projection head: for images
              Linear(dim, 512) - ReLU - Linear(512, 1024) on the flattened map (A.1), for text the
              identity on the mean over positions (A.1's default);
  early_exit  the cross-entropy of a local classifier on r_l: Linear(dim, 512) - ReLU -
              Linear(512, classes) on the flattened map for images, Linear(dim, dim) - Tanh -
              Linear(dim, classes) on the position mean for text (the models' own classifier shape).
The last component runs its units and the model's head, trained by the task loss. The local heads
are *affiliated* parameters: registered on the model (`model.scpl_projections`,
`model.early_exit_classifiers`) so the learner's optimizer and checkpoints include them; the model's
own forward never calls them (inference is f_L o ... o f_1), and `remove_local_heads(model)` drops them.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from edgetrain.methods.scpl.supcon import DEFAULT_TEMPERATURE, supcon_loss
from edgetrain.registry import EdgetrainError
from edgetrain.training.losses import task_loss

OBJECTIVES = ("supcon", "classifier")
HEAD_ATTRIBUTES = {"supcon": "scpl_projections", "classifier": "early_exit_classifiers"}
PROJECTIONS = ("auto", "mlp", "linear", "identity")


def is_text_model(model: nn.Module) -> bool:
    return hasattr(getattr(model, "config", None), "vocab_size")


def model_units(model: nn.Module) -> list[tuple[str, list[nn.Module]]]:
    """[(name, modules)] over embed and blocks; the embed merged into blocks.0 when it has no weights."""
    if not all(hasattr(model, a) for a in ("embed", "blocks", "head")):
        raise EdgetrainError(f"{type(model).__name__} has no block view (embed, blocks, head); SCPL cuts a "
                             "model into components along it -- use a model from the zoo")
    if getattr(model, "task", "classify") != "classify":
        raise EdgetrainError(f"SCPL trains classifiers (its local losses need class labels); "
                             f"{type(model).__name__} has task {model.task!r}")
    blocks = list(model.blocks)
    units: list[tuple[str, list[nn.Module]]] = [(f"blocks.{i}", [b]) for i, b in enumerate(blocks)]
    has_weights = any(True for _ in model.embed.parameters())
    if has_weights or not units:
        units.insert(0, ("embed", [model.embed]))
    else:
        units[0] = ("embed+" + units[0][0], [model.embed, *units[0][1]])
    return units


def split_counts(num_units: int, num_components: int | None, split: Sequence[int] | None) -> list[int]:
    """Units per component: `split` as given, else `num_components` (default min(4, units)) even parts."""
    if split is not None:
        counts = [int(n) for n in split]
        if min(counts, default=0) < 1 or sum(counts) != num_units or \
                (num_components is not None and len(counts) != num_components):
            raise EdgetrainError(f"split {list(split)} must give {num_components or 'some'} positive unit counts "
                                 f"summing to the model's {num_units} units")
        return counts
    if num_components is None:
        num_components = min(4, num_units)
    if not isinstance(num_components, int) or isinstance(num_components, bool) or num_components < 1:
        raise EdgetrainError(f"num_components must be a positive integer, got {num_components!r}")
    if num_components > num_units:
        raise EdgetrainError(f"{num_components} components need at least {num_components} units; the model has "
                             f"{num_units} (embed with weights + blocks)")
    base, extra = divmod(num_units, num_components)
    return [base + (1 if k < extra else 0) for k in range(num_components)]


class Pool(nn.Module):
    """[B, T, D] -> mean over T (text); anything else -> flattened per sample."""

    def __init__(self, sequence: bool) -> None:
        super().__init__()
        self.sequence = sequence

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.sequence:
            return h.mean(dim=1)
        return h.flatten(start_dim=1)


def projection_head(kind: str, dim: int, dims: Sequence[int], sequence: bool) -> nn.Module:
    hidden, out = dims
    if kind == "mlp":
        net: nn.Module = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, out))
    elif kind == "linear":
        net = nn.Linear(dim, out)
    else:
        net = nn.Identity()
    return nn.Sequential(Pool(sequence), net)


def local_classifier(dim: int, num_classes: int, hidden: int, sequence: bool) -> nn.Module:
    if sequence:
        return nn.Sequential(Pool(True), nn.Linear(dim, dim), nn.Tanh(), nn.Linear(dim, num_classes))
    return nn.Sequential(Pool(False), nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))


@contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    modes = {m: m.training for m in model.modules()}
    model.eval()
    try:
        yield
    finally:
        for module, mode in modes.items():
            module.training = mode


def unit_output_shapes(model: nn.Module, groups: list[list[nn.Module]], example: Any) -> list[tuple[int, ...]]:
    """Per-sample output shape of each group on an example input (eval mode, no grad: BatchNorm
    statistics and the global RNG are untouched)."""
    shapes = []
    with torch.no_grad(), _eval_mode(model):
        h = example
        for modules in groups:
            for module in modules:
                h = module(h)
            shapes.append(tuple(h.shape[1:]))
    return shapes


def example_batch(model: nn.Module, example_inputs: torch.Tensor | None) -> torch.Tensor:
    if example_inputs is not None:
        return example_inputs
    from edgetrain.models.zoo import example_input

    try:
        example = example_input(model, 2, 8, generator=torch.Generator().manual_seed(0))
    except (TypeError, AttributeError):
        raise EdgetrainError(f"cannot read {type(model).__name__}'s input shape from a config; pass "
                             "method_options={'example_inputs': a small batch of inputs}") from None
    reference = next(model.parameters())
    # Features and images in the model's dtype: a float64 or bf16 model refuses float32 inputs.
    return example.to(reference.device, dtype=reference.dtype if example.is_floating_point() else None)


@dataclass
class Component:
    """Component `index`: its units (modules of the model), and either its local head (l < L) or the
    model's head (the last one). `params` maps the model's parameter names to the component's
    trainable parameters, local head included."""

    index: int
    name: str
    modules: list[nn.Module]
    model: nn.Module
    objective: str
    local_head: nn.Module | None
    is_last: bool
    temperature: float = DEFAULT_TEMPERATURE
    reduction: str = "mean"
    params: dict[str, nn.Parameter] = field(default_factory=dict)

    def encode(self, h: torch.Tensor) -> torch.Tensor:
        """f_l(h): the component's units on its (detached) input; logits for the last component."""
        if isinstance(h, torch.Tensor) and h.requires_grad:
            h = h.detach()  # the boundary: no gradient ever reaches the previous component
        for module in self.modules:
            h = module(h)
        if self.is_last:
            h = self.model.head(h)
        return h

    def local_loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The component's own objective on its output: task loss (last), SupCon of g_l(r_l), or the
        local classifier's cross-entropy."""
        if self.is_last:
            return task_loss(self.model, output, targets)
        assert self.local_head is not None
        if self.objective == "supcon":
            return supcon_loss(self.local_head(output), targets, temperature=self.temperature,
                               reduction=self.reduction)
        return F.cross_entropy(self.local_head(output).float(), targets)

    def modules_for_device(self) -> list[nn.Module]:
        """Everything the component runs: its units, and its local head or the model's head."""
        extra = [self.model.head] if self.is_last else [self.local_head]
        return [*self.modules, *[m for m in extra if m is not None]]


def build_components(model: nn.Module, objective: str, *, num_components: int | None = None,
                     split: Sequence[int] | None = None, projection: str = "auto",
                     projection_dims: Sequence[int] = (512, 1024), classifier_hidden: int = 512,
                     temperature: float = DEFAULT_TEMPERATURE, reduction: str = "mean", seed: int = 0,
                     example_inputs: torch.Tensor | None = None) -> list[Component]:
    """The components of `model`, with their local heads created (seeded) or reused from the model."""
    if objective not in OBJECTIVES:
        raise EdgetrainError(f"unknown local objective {objective!r}; known: {', '.join(OBJECTIVES)}")
    if projection not in PROJECTIONS:
        raise EdgetrainError(f"projection must be one of {', '.join(PROJECTIONS)}, got {projection!r}")
    projection_dims = tuple(int(d) for d in projection_dims)
    if len(projection_dims) != 2 or min(projection_dims) < 1:
        raise EdgetrainError(f"projection_dims must be (hidden, out), got {projection_dims}")
    units = model_units(model)
    counts = split_counts(len(units), num_components, split)
    groups, names, start = [], [], 0
    for count in counts:
        chunk = units[start:start + count]
        groups.append([m for _, ms in chunk for m in ms])
        names.append("+".join(n for n, _ in chunk))
        start += count
    names[-1] += "+head"
    text = is_text_model(model)
    if projection == "auto":
        projection = "identity" if text else "mlp"
    num_classes = getattr(getattr(model, "config", None), "num_classes", None)
    shapes: list[tuple[int, ...]] = []
    if len(groups) > 1:
        shapes = unit_output_shapes(model, groups[:-1], example_batch(model, example_inputs))
    heads = _local_heads(model, objective, shapes, text, projection, projection_dims, classifier_hidden,
                         num_classes, seed)
    trainable = {id(p): n for n, p in model.named_parameters() if p.requires_grad}
    components, owner = [], {}
    for index, (modules, name) in enumerate(zip(groups, names)):
        is_last = index == len(groups) - 1
        component = Component(index, name, modules, model, objective, None if is_last else heads[index], is_last,
                              temperature, reduction)
        for module in component.modules_for_device():
            for param in module.parameters():
                if id(param) in trainable:
                    if owner.setdefault(id(param), index) != index:
                        raise EdgetrainError(f"parameter {trainable[id(param)]} is used by components {owner[id(param)]} "
                                             f"and {index} (tied weights); each component must own its parameters")
                    component.params[trainable[id(param)]] = param
        components.append(component)
    # A trainable parameter no component owns would never get a gradient: its model would train a
    # function other than model(x) (e.g. a scale applied before the head, outside embed/blocks/head).
    # (The local heads of the other objective, left on the model by an earlier method, are not part of
    # model(x) either way.)
    other_heads = tuple(f"{attribute}." for attribute in HEAD_ATTRIBUTES.values())
    unowned = sorted(name for key, name in trainable.items() if key not in owner and not name.startswith(other_heads))
    if unowned:
        raise EdgetrainError(f"{type(model).__name__}: trainable parameters outside the components "
                             f"({', '.join(unowned[:3])}{', ...' if len(unowned) > 3 else ''}) would never train; "
                             "local learning needs every trainable parameter inside embed/blocks/head "
                             "(or freeze them with requires_grad_(False))")
    return components


def _local_heads(model: nn.Module, objective: str, shapes: list[tuple[int, ...]], text: bool, projection: str,
                 projection_dims: tuple[int, ...], classifier_hidden: int, num_classes: int | None,
                 seed: int) -> nn.ModuleList:
    attribute = HEAD_ATTRIBUTES[objective]
    sequence = [text and len(shape) == 2 for shape in shapes]
    dims = [shape[-1] if seq else int(torch.Size(shape).numel()) for shape, seq in zip(shapes, sequence)]
    if objective == "classifier" and num_classes is None:
        raise EdgetrainError("early_exit needs the number of classes (model.config.num_classes)")
    signature = (objective, projection, projection_dims, classifier_hidden, tuple(dims), tuple(sequence), num_classes)
    existing = getattr(model, attribute, None)
    if isinstance(existing, nn.ModuleList) and getattr(existing, "signature", None) == signature:
        return existing  # the model already carries these heads (a second learner, a resumed run)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        heads = nn.ModuleList(
            projection_head(projection, dim, projection_dims, seq) if objective == "supcon"
            else local_classifier(dim, num_classes, classifier_hidden, seq)
            for dim, seq in zip(dims, sequence))
    reference = next(model.parameters(), None)
    if reference is not None:
        heads = heads.to(device=reference.device, dtype=reference.dtype)
    heads.signature = signature
    if attribute in model._modules:
        del model._modules[attribute]
    model.add_module(attribute, heads)
    return heads


def remove_local_heads(model: nn.Module) -> nn.Module:
    """Drop the affiliated parameters SCPL / Early Exit registered on `model` (for inference, export)."""
    for attribute in HEAD_ATTRIBUTES.values():
        if attribute in model._modules:
            del model._modules[attribute]
    return model


def describe_components(components: Sequence[Component]) -> str:
    """'embed+blocks.0 | blocks.1 | blocks.2+head' -- for logs and benchmark tables."""
    return " | ".join(c.name for c in components)
