"""MLXEngine: the Learner's tensor work for MLX decoders (edgetrain.training.engine says what an engine is).

Batches are edgetrain Batches (torch tensors, as every stream yields); they are validated as for torch and
converted to MLX arrays. Randomness (LoRA dropout) is a pure function of (seed, step): each step reseeds
MLX's generator, so neither a failed step nor a resume needs an RNG state.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Iterable

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from edgetrain.backends.mlx.loading import to_numpy
from edgetrain.backends.mlx.lora import set_parameters, trainable_parameters
from edgetrain.backends.mlx.methods import MLX_METHODS
from edgetrain.backends.mlx.optim import FlatOptimizer
from edgetrain.backends.mlx.token_loss import token_losses
from edgetrain.data.batch import Batch
from edgetrain.data.validate import validate_batch
from edgetrain.methods.base import NonFiniteError
from edgetrain.registry import EdgetrainError
from edgetrain.training.checkpoint import CorruptCheckpointError
from edgetrain.training.checkpoint_content import check_saved_tensor
from edgetrain.training.schedules import ScheduleError, check_learning_rate

CHECKPOINT_FORMAT = "edgetrain-mlx-learner-1"


def batch_arrays(batch: Batch) -> tuple[mx.array, mx.array]:
    """A Batch's token ids and targets as int32 MLX arrays (ids < 2^31: any real vocabulary)."""
    return (mx.array(batch.inputs.cpu().numpy().astype(np.int32)),
            mx.array(batch.targets.cpu().numpy().astype(np.int32)))


def _as_torch(array: mx.array):
    import torch

    values = to_numpy(array)
    if values.dtype.kind == "u":  # the optimizer's uint64 step counter: torch takes int64
        values = values.astype(np.int64)
    return torch.from_numpy(values.copy())  # (np.ascontiguousarray would make a scalar 1-d)


def _flatten_state(state: dict) -> dict[str, mx.array]:
    """The optimizer state {param name: {"m": ..}, "step": ..} as {"<param name>/m": .., "step": ..}.
    (Not mlx.utils.tree_flatten: parameter names hold dots, which it would split on the way back.)"""
    flat = {}
    for name, value in state.items():
        if isinstance(value, dict):
            flat.update({f"{name}/{key}": inner for key, inner in value.items()})
        else:
            flat[name] = value
    return flat


def _unflatten_state(flat: dict[str, mx.array]) -> dict:
    state: dict = {}
    for name, value in flat.items():
        if "/" in name:
            param, key = name.rsplit("/", 1)
            state.setdefault(param, {})[key] = value
        else:
            state[name] = value
    return state


class PeakWindow:
    """The MLX probe's peak during a step above its reading just before (StepWindow)."""

    def __init__(self, probe: Any) -> None:
        self.probe, self.added_bytes = probe, None

    def __enter__(self) -> "PeakWindow":
        self.probe.reset_peak()
        self.baseline = self.probe.current_bytes()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.added_bytes = max(0, self.probe.peak_bytes() - self.baseline)


class MLXEngine:
    framework = "mlx"
    methods = MLX_METHODS
    checkpoint_format = CHECKPOINT_FORMAT
    checkpoint_kind = "MLX learner"
    state_keys = ("steps_done", "stream_position", "method")

    def __init__(self, device: str) -> None:
        self.device = device

    # -- set-up ---------------------------------------------------------------------------------
    def seed(self, seed: int | None) -> None:
        if seed is not None:
            mx.random.seed(seed)

    def adopt(self, model: nn.Module) -> nn.Module:
        model.train()  # MLX arrays live in unified memory: nothing to move
        return model

    def trainable(self, model: nn.Module) -> dict[str, mx.array]:
        return trainable_parameters(model)

    def live_parameters(self, model: nn.Module, captured: dict[str, mx.array]) -> dict[str, mx.array]:
        return trainable_parameters(model)  # arrays are immutable: an update rebinds them in the model

    def held(self, model: nn.Module, captured: dict[str, mx.array]) -> dict[str, mx.array]:
        return trainable_parameters(model)

    def make_optimizer(self, kind: str | Callable, model: nn.Module, params: dict[str, mx.array], lr: float,
                       options: dict[str, Any]) -> FlatOptimizer:
        return FlatOptimizer(model, kind, lr, **options)

    def group_rates(self, optimizer: FlatOptimizer) -> list[float]:
        return [optimizer.learning_rate]

    def set_group_rates(self, optimizer: FlatOptimizer, rates: list[float]) -> None:
        optimizer.optimizer.learning_rate = rates[0]

    def probe_without_os_probe(self, model: nn.Module) -> Any:
        return None  # MLX has no tensor accounting: a budget needs the MLX probe

    def weights_bytes(self, model: nn.Module) -> int:
        return sum(v.nbytes for _, v in tree_flatten(model.parameters()))

    # -- one batch ------------------------------------------------------------------------------
    def prepare(self, batch: Batch, model: nn.Module) -> tuple[mx.array, mx.array]:
        validate_batch(batch, task="lm", vocab_size=model.config.vocab_size, num_classes=None)
        inputs, targets = batch_arrays(batch)
        mx.eval(inputs, targets)
        return inputs, targets

    def begin_step(self, seed: int | None, steps_done: int) -> None:
        if seed is not None:
            mx.random.seed((seed * 1_000_003 + steps_done) % 2**32)

    def set_threads(self, count: int) -> bool:
        return False  # MLX sizes its own CPU pool (and runs on the GPU on Apple silicon)

    def run_step(self, method: Any, prepared: tuple[mx.array, mx.array], optimizer: FlatOptimizer) -> mx.array:
        loss = method.step(*prepared, optimizer)
        mx.eval(loss)
        return loss

    def gradients(self, method: Any, prepared: tuple[mx.array, mx.array]) -> tuple[mx.array, dict[str, mx.array]]:
        return method.gradients(*prepared)

    def step_window(self, probe: Any) -> PeakWindow:
        return PeakWindow(probe)

    def after_failed_step(self, optimizer: FlatOptimizer) -> None:
        pass  # FlatOptimizer.apply refuses a non-finite gradient before anything changes

    def clear_gradients(self, optimizer: FlatOptimizer) -> None:
        pass  # gradients are returned, never stored on the parameters

    def snapshot(self, params: dict[str, mx.array], optimizer: FlatOptimizer) -> Any:
        # Arrays are immutable: holding the current ones is the copy.
        return dict(params), optimizer.state_snapshot()

    def restore_snapshot(self, model: nn.Module, params: dict[str, mx.array], optimizer: FlatOptimizer,
                         snapshot: Any) -> None:
        set_parameters(model, snapshot[0])
        optimizer.restore_snapshot(snapshot[1])

    def side_state(self, model: nn.Module) -> Any:
        return None  # randomness is reseeded from (seed, step) by begin_step

    def restore_side_state(self, side_state: Any) -> None:
        pass

    def evaluate(self, model: nn.Module, prepared_batches: Iterable[tuple[Batch, Any]]) -> dict[str, float]:
        """Mean loss over the batches (weighted by tokens) and perplexity."""
        total_loss, total_weight = 0.0, 0
        for batch, (inputs, targets) in prepared_batches:
            losses = token_losses(model, inputs, targets)  # the head a chunk of positions at a time
            total_loss += float(losses.sum())
            total_weight += losses.size
        if total_weight == 0:
            raise EdgetrainError("evaluate() got no batches")
        metrics = {"loss": total_loss / total_weight}
        metrics["perplexity"] = math.exp(min(metrics["loss"], 50.0))
        return metrics

    # -- accumulated steps ------------------------------------------------------------------------
    def add_gradients(self, total: dict[str, mx.array] | None, grads: dict[str, mx.array],
                      weight: float) -> dict[str, mx.array]:
        """total + weight x grads, summed in float32."""
        weighted = {name: g.astype(mx.float32) * weight for name, g in grads.items()}
        total = weighted if total is None else {name: total[name] + g for name, g in weighted.items()}
        mx.eval(total)
        return total

    def apply_gradients(self, optimizer: FlatOptimizer, params: dict[str, mx.array], grads: dict[str, mx.array],
                        max_norm: float | None) -> float:
        """One optimizer update with `grads`, scaled to a global L2 norm of `max_norm` when they exceed it;
        their norm before. FlatOptimizer refuses a non-finite gradient before anything changes."""
        norm = math.sqrt(sum(float(mx.sum(g ** 2)) for g in grads.values()))
        if not math.isfinite(norm):
            raise NonFiniteError(f"the accumulated gradient's norm is {norm}")
        factor = 1.0 if max_norm is None or norm <= max_norm else max_norm / norm
        optimizer.apply({name: (g * factor).astype(params[name].dtype) for name, g in grads.items()})
        return norm

    # -- checkpoints ----------------------------------------------------------------------------
    def checkpoint_tensors(self, learner: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        # No RNG state (begin_step reseeds); frozen base weights are not written: they come from the base model.
        tensors = {f"param/{name}": _as_torch(p) for name, p in learner.params.items()}
        tensors.update({f"optimizer/{name}": _as_torch(value)
                        for name, value in _flatten_state(learner.optimizer.optimizer.state).items()})
        return tensors, {}

    def check_restore(self, learner: Any, tensors: dict[str, Any], state: dict, source: str) -> Any:
        """The checkpoint's weights and optimizer state as MLX arrays, after checking each against the
        learner's (CorruptCheckpointError, so that resume falls back to the previous checkpoint): there,
        of the same shape, finite, floating point (the step count a whole number >= 0), the learning rate in
        range. (Weights are saved widened to float32 where numpy has no dtype of theirs: bfloat16.)"""
        restored = {}
        for name, param in learner.params.items():
            saved = check_saved_tensor(tensors.get(f"param/{name}"), f"parameter {name!r}", tuple(param.shape),
                                       source)
            restored[name] = mx.array(saved.float().numpy()).astype(param.dtype)
        restored_state = {}
        for name, value in _flatten_state(learner.optimizer.optimizer.state).items():
            what = f"optimizer state {name!r}"
            floating = mx.issubdtype(value.dtype, mx.floating)
            saved = check_saved_tensor(tensors.get(f"optimizer/{name}"), what, tuple(value.shape), source,
                                       floating=floating)
            if not floating and (saved.is_floating_point() or saved.is_complex() or bool((saved < 0).any())):
                raise CorruptCheckpointError(f"{source}: {what} is {saved.tolist()!r}, not a whole number >= 0")
            if name == "learning_rate":
                try:
                    check_learning_rate(float(saved.reshape(-1)[0]) if saved.numel() else None, what)
                except ScheduleError as exc:
                    raise CorruptCheckpointError(f"{source}: {exc}") from None
            restored_state[name] = mx.array(saved.numpy()).astype(value.dtype)
        return restored, restored_state

    def restore_point(self, learner: Any) -> Any:
        return None  # the snapshot of weights and optimizer state is all there is

    def apply_restore(self, learner: Any, tensors: dict[str, Any], state: dict, checked: Any) -> None:
        restored, restored_state = checked
        set_parameters(learner.model, restored)
        learner.optimizer.optimizer.state = _unflatten_state(restored_state)
        mx.eval(learner.model.trainable_parameters(), learner.optimizer.optimizer.state)

    def roll_back_restore(self, learner: Any, point: Any) -> None:
        pass
