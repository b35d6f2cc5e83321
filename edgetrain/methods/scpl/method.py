"""`scpl` and `early_exit`: training with a local objective per component, no gradient across them.

Both cut the model into components (components.py). A step, in one process and in order:

    inputs, targets = two augmented views of the batch (images) or the batch itself (text)
    h = inputs
    for component l = 1 .. L:
        r_l = f_l(h.detach())                   # the boundary: no gradient reaches component l-1
        loss_l = local objective of r_l         # SupCon of g_l(r_l) | a local classifier's CE | the task loss (l = L)
        loss_l.backward()                       # frees component l's graph before l+1 runs
        h = r_l
    optimizer.step()                            # every component, once

The sum of the backward calls is the gradient of Eq. (3), sum_l L_l^SC + L^OUT, with the detaches in
place: each parameter's gradient comes from its own component's loss only. Because a component's
gradient depends only on its input, which the previous component computed with its weights before
this step's update, the pipelined run (edgetrain.recipes.scpl_pipeline, one process per
component) computes exactly the same updates. Peak activation memory is one component's graph.

What the protocol methods return: step() and gradients() return the last component's task loss (on
the views the step trained on); every component's loss is in `last_losses`. gradients() covers the
local heads too (they are trainable parameters registered on the model).

Options (Learner(method_options=...)):
  num_components   -- L (default min(4, units)); split -- units per component, e.g. [3, 2, 2, 2]
  views            -- "auto" (2 for image models, 1 for text and flat-feature models), or a number
  augment          -- overrides of appendix A.1's augmentation (augment.AugmentConfig fields)
  temperature      -- SupCon's tau (0.1); reduction -- "mean" over anchors (default) or "sum" (Eq. 2)
  projection       -- "auto" (MLP for images, identity for text), "mlp", "linear", "identity";
                      projection_dims -- (hidden, out) of the MLP, (512, 1024)
  classifier_hidden -- early_exit's local classifier width for images (512)
  seed             -- seeds the local heads' initialisation and the augmentation draws (0)
  example_inputs   -- a small input batch, for models whose config does not give the input shape
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from edgetrain.data.batch import Batch
from edgetrain.methods.base import METHODS, require_finite, take_gradients, trainable_parameters
from edgetrain.methods.scpl.augment import AugmentConfig, augment_config, make_views
from edgetrain.methods.scpl.components import (Component, build_components, describe_components,
                                               is_text_model)
from edgetrain.methods.scpl.supcon import DEFAULT_TEMPERATURE
from edgetrain.registry import EdgetrainError


def model_image_shape(model: nn.Module) -> tuple[int, int, int] | None:
    """(C, H, W) of the images a model takes, read off its config; None for text and flat features."""
    if is_text_model(model) or getattr(model, "config", None) is None:
        return None
    from edgetrain.models.zoo import example_input

    try:
        example = example_input(model, 1, 0, generator=torch.Generator().manual_seed(0))
    except (TypeError, AttributeError):
        return None
    return tuple(example.shape[1:]) if example.dim() == 4 else None  # type: ignore[return-value]


class LocalLearning:
    """A training method whose components learn from local objectives (SCPL, Early Exit)."""

    partial_updates = False

    def __init__(self, name: str, objective: str, model: nn.Module, *, num_components: int | None = None,
                 split: Sequence[int] | None = None, views: int | str = "auto",
                 augment: AugmentConfig | dict[str, Any] | None = None, temperature: float = DEFAULT_TEMPERATURE,
                 reduction: str = "mean", projection: str = "auto", projection_dims: Sequence[int] = (512, 1024),
                 classifier_hidden: int = 512, seed: int = 0, example_inputs: torch.Tensor | None = None) -> None:
        self.name = name
        self.model = model
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise EdgetrainError(f"{name}: seed must be an integer, got {seed!r}")
        self.seed = seed
        self.components: list[Component] = build_components(
            model, objective, num_components=num_components, split=split, projection=projection,
            projection_dims=projection_dims, classifier_hidden=classifier_hidden, temperature=temperature,
            reduction=reduction, seed=seed, example_inputs=example_inputs)
        self.params = trainable_parameters(model)
        self.image_shape = model_image_shape(model)
        if example_inputs is not None and example_inputs.dim() == 4:
            self.image_shape = tuple(example_inputs.shape[1:])
        if views == "auto":
            views = 2 if self.image_shape is not None else 1
        if isinstance(views, bool) or not isinstance(views, int) or views < 1:
            raise EdgetrainError(f"{name}: views must be 'auto' or a positive integer, got {views!r}")
        if views > 1 and self.image_shape is None:
            raise EdgetrainError(f"{name}: {views} views need image inputs (augmentations act on [C, H, W]); "
                                 f"{type(model).__name__} takes {'token ids' if is_text_model(model) else 'flat features'}"
                                 " -- use views=1")
        self.num_views = views
        self.augment = augment_config(augment)
        self.last_losses: list[float] = []

    # -- facts ---------------------------------------------------------------------------------
    @property
    def num_components(self) -> int:
        return len(self.components)

    @property
    def split(self) -> str:
        return describe_components(self.components)

    # -- one batch -----------------------------------------------------------------------------
    def batch_views(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """The inputs the components train on (all views, view-major) and their targets."""
        shape = tuple(batch.inputs.shape[1:]) if batch.inputs.dim() == 4 else self.image_shape
        return make_views(batch.inputs, batch.targets, num_views=self.num_views, image_shape=shape, seed=self.seed,
                          batch_index=batch.index, config=self.augment)

    def local_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> list[torch.Tensor]:
        """Component after component: forward on the detached input, local loss, its backward. Gradients
        accumulate into .grad; returns the detached local losses. Raises NonFiniteError before any
        backward of a non-finite loss (the weights are not touched here either way)."""
        losses, h = [], inputs
        for component in self.components:
            output = component.encode(h)
            loss = component.local_loss(output, targets)
            require_finite(float(loss.detach()), f"local loss of component {component.index} ({component.name})")
            if loss.requires_grad:
                loss.backward()
            losses.append(loss.detach())
            h = output.detach()
            del output, loss
        self.last_losses = [float(loss) for loss in losses]
        return losses

    def gradients(self, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        for param in self.params.values():
            param.grad = None
        losses = self.local_backward(*self.batch_views(batch))
        return losses[-1], take_gradients(self.params)

    def step(self, batch: Batch, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        losses = self.local_backward(*self.batch_views(batch))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return losses[-1]

    # -- resuming ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        # Views are drawn from (seed, batch index): nothing else to carry.
        return {"seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state.get("seed", self.seed)) != self.seed:
            raise EdgetrainError(f"{self.name}: the checkpoint was written with seed {state['seed']}, this "
                                 f"learner has seed {self.seed}; the augmented views would differ")


OPTIONS = ("num_components", "split", "views", "augment", "temperature", "reduction", "projection",
           "projection_dims", "classifier_hidden", "seed", "example_inputs")


def check_options(name: str, options: dict[str, Any], not_applicable: Sequence[str]) -> None:
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise EdgetrainError(f"method {name!r}: unknown option(s) {', '.join(unknown)}; known: "
                             f"{', '.join(o for o in OPTIONS if o not in not_applicable)}")
    for option in not_applicable:
        if option in options:
            raise EdgetrainError(f"method {name!r}: option {option!r} does not apply")


class SCPL(LocalLearning):
    def __init__(self, model: nn.Module, **options: Any) -> None:
        check_options("scpl", options, ("classifier_hidden",))
        super().__init__("scpl", "supcon", model, **options)


class EarlyExit(LocalLearning):
    def __init__(self, model: nn.Module, **options: Any) -> None:
        # Local classifiers, not SupCon projections.
        check_options("early_exit", options, ("temperature", "reduction", "projection", "projection_dims"))
        super().__init__("early_exit", "classifier", model, **options)


METHODS.add("scpl", SCPL)
METHODS.add("early_exit", EarlyExit)
