"""What gets exported: a model with some weights trainable, wrapped so that its loss is computed inside.

Both device runtimes train a program that takes (inputs, targets) and returns the loss, so the loss the
learner optimises (edgetrain.training.losses.task_loss: cross-entropy over next tokens or over classes) lives
inside the exported module, as its first (and only) output. Which weights learn is decided before export
by `requires_grad`, exactly as for the Learner:

  "lora" -- a decoder with LoRA adapters (edgetrain.add_lora): adapters learn, the base is frozen;
  "head" -- a classifier whose head (model.head) learns over the frozen features of embed + blocks.

Shapes are fixed at export: a program runs batches of the example batch's shape and dtype only.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

from edgetrain.data.batch import Batch
from edgetrain.registry import EdgetrainError
from edgetrain.training.losses import task_loss

TRAINABLE_PARTS = ("lora", "head")
# Parameter names inside the exported program are the model's own names under this prefix.
WRAPPED_PREFIX = "model."


class ExportError(EdgetrainError):
    """A model, batch or runtime that cannot be exported or run (names the op, shape or package)."""


def require(module: str, what: str) -> object:
    """Import an optional dependency of the `export` extra, or say how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ExportError(f"{what} needs the optional package {module.split('.')[0]!r} ({exc}); "
                          "install it with: pip install 'edgetrain[export]'") from None


class LossModule(nn.Module):
    """model + its task loss: forward(inputs, targets) -> (loss,), the layout on-device training takes."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor]:
        return (task_loss(self.model, self.model(inputs), targets),)


def make_trainable(model: nn.Module, part: str, *, rank: int = 8) -> nn.Module:
    """Freeze `model` except `part` (in place): "lora" adds adapters when absent, "head" unfreezes model.head."""
    if part not in TRAINABLE_PARTS:
        raise ExportError(f"unknown trainable part {part!r}; known: {', '.join(TRAINABLE_PARTS)}")
    if part == "lora":
        from edgetrain.models.lora import add_lora, lora_layers

        if getattr(model, "task", None) != "lm":
            raise ExportError(f"trainable part 'lora' is for decoders; {type(model).__name__} is a "
                              f"{getattr(model, 'task', 'model')!r} model (use 'head')")
        if not lora_layers(model):
            add_lora(model, rank=rank)
        return model
    if not hasattr(model, "head"):
        raise ExportError(f"{type(model).__name__} has no block view (model.head); cannot train its head")
    for param in model.parameters():
        param.requires_grad_(False)
    for param in model.head.parameters():
        param.requires_grad_(True)
    return model


def default_part(model: nn.Module) -> str:
    return "lora" if getattr(model, "task", None) == "lm" else "head"


def trainable_names(model: nn.Module) -> list[str]:
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    if not names:
        raise ExportError(f"{type(model).__name__} has no trainable parameters to export "
                          "(add LoRA adapters or unfreeze the head)")
    return names


def example_batch(model: nn.Module, batch_size: int, seq_len: int, seed: int = 0) -> Batch:
    """A batch of the shape the program will be exported for (random ids/features and targets)."""
    from edgetrain.models.zoo import example_input

    generator = torch.Generator().manual_seed(seed)
    inputs = example_input(model, batch_size, seq_len, generator=generator)
    config = model.config
    if getattr(model, "task", None) == "lm":
        targets = torch.randint(0, config.vocab_size, inputs.shape, generator=generator)
    else:
        targets = torch.randint(0, config.num_classes, (batch_size,), generator=generator)
    return Batch(inputs, targets, 0)


@dataclass(frozen=True)
class BatchSignature:
    """The fixed shapes and dtypes an exported program takes."""

    inputs_shape: tuple[int, ...]
    inputs_dtype: torch.dtype
    targets_shape: tuple[int, ...]
    targets_dtype: torch.dtype

    @classmethod
    def of(cls, batch: Batch) -> "BatchSignature":
        return cls(tuple(batch.inputs.shape), batch.inputs.dtype, tuple(batch.targets.shape), batch.targets.dtype)

    def check(self, batch: Batch, runtime: str) -> None:
        for what, tensor, shape, dtype in (("inputs", batch.inputs, self.inputs_shape, self.inputs_dtype),
                                           ("targets", batch.targets, self.targets_shape, self.targets_dtype)):
            if tuple(tensor.shape) != shape or tensor.dtype != dtype:
                raise ExportError(
                    f"batch {batch.index}: {what} of shape {tuple(tensor.shape)} {tensor.dtype}, but the "
                    f"{runtime} program was exported for {shape} {dtype}; shapes are fixed at export, so "
                    "re-export for this batch/sequence size (edgetrain export --batch/--seq)")


def strip_prefix(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Program parameter names -> the model's own parameter names (as the Learner uses)."""
    return {name[len(WRAPPED_PREFIX):] if name.startswith(WRAPPED_PREFIX) else name: t
            for name, t in named.items()}


def torch_sgd_trajectory(model: nn.Module, batches: Iterable[Batch], lr: float
                         ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The reference: the same steps by edgetrain.Learner (plain backprop, SGD) in torch.

    Returns the loss of every step (before its update) and the trainable weights after the last one."""
    from edgetrain.training.learner import Learner

    learner = Learner(model, method="bp", optimizer="sgd", lr=lr, probe=False, seed=None)
    losses = [learner.step(batch).loss for batch in batches]
    return losses, {name: p.detach().clone() for name, p in learner.params.items()}
