"""TorchEngine: the Learner's tensor work for torch models (edgetrain.training.engine says what an engine is)."""
from __future__ import annotations

import copy
import math
from typing import Any, Callable, Iterable

import torch
from torch import nn

from edgetrain.backends.torch.finite_steps import FiniteOptimizerSteps
from edgetrain.backends.torch.learner_state import CHECKPOINT_FORMAT, apply_restored, checkpoint_tensors, state_buffers
from edgetrain.backends.torch.optimizers import make_optimizer
from edgetrain.data.batch import Batch
from edgetrain.data.validate import batch_expectations, validate_batch
from edgetrain.methods.base import METHODS, NonFiniteError, trainable_parameters
from edgetrain.models.token_loss import is_block_decoder, summed_token_loss
from edgetrain.registry import EdgetrainError
from edgetrain.training.checkpoint import unflatten_optimizer_state
from edgetrain.training.checkpoint_content import check_optimizer_state, check_saved_tensor
from edgetrain.training.losses import task_loss
from edgetrain.training.step_memory import StepMemory


class TorchEngine:
    framework = "torch"
    methods = METHODS
    checkpoint_format = CHECKPOINT_FORMAT
    checkpoint_kind = "learner"
    state_keys = ("steps_done", "stream_position", "method", "optimizer")

    def __init__(self, device: str) -> None:
        self.device = device
        self.finite_steps: FiniteOptimizerSteps | None = None

    # -- set-up ---------------------------------------------------------------------------------
    def seed(self, seed: int | None) -> None:
        if seed is not None:
            torch.manual_seed(seed)

    def adopt(self, model: nn.Module) -> nn.Module:
        model = model.to(self.device)
        model.train()
        return model

    def trainable(self, model: nn.Module) -> dict[str, nn.Parameter]:
        return trainable_parameters(model)

    def live_parameters(self, model: nn.Module, captured: dict[str, nn.Parameter]) -> dict[str, nn.Parameter]:
        # The parameters trainable when the learner was made, for good: a staged method (SegProp) freezes
        # some for a while, and they stay in the checkpoints. Learner.finish() drops those the model no
        # longer holds (training-only adapters), through `held`.
        return captured

    def held(self, model: nn.Module, captured: dict[str, nn.Parameter]) -> dict[str, nn.Parameter]:
        ids = {id(p) for p in model.parameters()}
        return {name: p for name, p in captured.items() if id(p) in ids}

    def make_optimizer(self, kind: str | Callable, model: nn.Module, params: dict[str, nn.Parameter], lr: float,
                       options: dict[str, Any]) -> torch.optim.Optimizer:
        optimizer = make_optimizer(kind, list(params.values()), lr, **options)
        # Every optimizer step, also the per-block steps of fused methods, is all or nothing.
        self.finite_steps = FiniteOptimizerSteps(optimizer, params)
        return optimizer

    def group_rates(self, optimizer: torch.optim.Optimizer) -> list[float]:
        return [group["lr"] for group in optimizer.param_groups]

    def set_group_rates(self, optimizer: torch.optim.Optimizer, rates: list[float]) -> None:
        for group, rate in zip(optimizer.param_groups, rates):
            group["lr"] = rate

    def probe_without_os_probe(self, model: nn.Module) -> Any:
        from edgetrain.probes import TensorAccountant

        # Tensor accounting sees every tensor torch allocates (not the allocator's slack): good enough
        # to refuse a step that cannot fit.
        return TensorAccountant(model)

    def weights_bytes(self, model: nn.Module) -> int:
        tensors = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
        return sum(t.numel() * t.element_size() for t in tensors.values())

    # -- one batch ------------------------------------------------------------------------------
    def prepare(self, batch: Batch, model: nn.Module) -> Batch:
        validate_batch(batch, **batch_expectations(model))
        return batch.to(self.device)

    def begin_step(self, seed: int | None, steps_done: int) -> None:
        pass  # torch's generator state is saved with the side state and the checkpoints

    def set_threads(self, count: int) -> bool:
        if torch.get_num_threads() != count:
            torch.set_num_threads(count)
        return True

    def run_step(self, method: Any, prepared: Batch, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        return method.step(prepared, optimizer)

    def gradients(self, method: Any, prepared: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return method.gradients(prepared)

    def step_window(self, probe: Any) -> StepMemory:
        # What the step adds to the memory held before it (edgetrain/training/step_memory.py says how it is read).
        return StepMemory(probe)

    def after_failed_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.finite_steps is not None:
            self.finite_steps.put_back_interrupted(optimizer)

    def clear_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)

    def snapshot(self, params: dict[str, nn.Parameter], optimizer: torch.optim.Optimizer) -> Any:
        return ({name: p.detach().clone() for name, p in params.items()}, copy.deepcopy(optimizer.state_dict()))

    def restore_snapshot(self, model: nn.Module, params: dict[str, nn.Parameter], optimizer: torch.optim.Optimizer,
                         snapshot: Any) -> None:
        weights, optimizer_state = snapshot
        with torch.no_grad():
            for name, param in params.items():
                param.copy_(weights[name])
        optimizer.load_state_dict(optimizer_state)

    def side_state(self, model: nn.Module) -> Any:
        """The RNG state and copies of the running statistics of normalisation layers in training mode
        (the buffers a forward updates); small next to the weights."""
        running = [(buffer, buffer.clone()) for module in model.modules()
                   if isinstance(module, nn.modules.batchnorm._NormBase) and module.training
                   for buffer in module.buffers(recurse=False)]
        return torch.get_rng_state(), running

    def restore_side_state(self, side_state: Any) -> None:
        rng, running = side_state
        torch.set_rng_state(rng)
        with torch.no_grad():
            for buffer, kept in running:
                buffer.copy_(kept)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, prepared_batches: Iterable[tuple[Batch, Batch]]) -> dict[str, float]:
        """Mean loss over the batches (weighted by tokens or samples), perplexity for language models,
        accuracy for classifiers."""
        classify = getattr(model, "task", "classify") == "classify"
        total_loss, total_weight, correct = 0.0, 0, 0
        for _, batch in prepared_batches:
            if is_block_decoder(model):  # the head a chunk of positions at a time: no whole-batch logits
                batch_loss, tokens = summed_token_loss(model, batch.inputs, batch.targets)
                total_loss, total_weight = total_loss + batch_loss, total_weight + tokens
                continue
            outputs = model(batch.inputs)
            weight = batch.num_tokens
            total_loss += float(task_loss(model, outputs, batch.targets)) * weight
            total_weight += weight
            if classify:
                correct += int((outputs.argmax(-1) == batch.targets).sum())
        if total_weight == 0:
            raise EdgetrainError("evaluate() got no batches")
        metrics = {"loss": total_loss / total_weight}
        if getattr(model, "task", "classify") == "lm":
            metrics["perplexity"] = math.exp(min(metrics["loss"], 50.0))
        else:
            metrics["accuracy"] = correct / total_weight
        return metrics

    # -- accumulated steps ------------------------------------------------------------------------
    def add_gradients(self, total: dict[str, torch.Tensor] | None, grads: dict[str, torch.Tensor],
                      weight: float) -> dict[str, torch.Tensor]:
        """total + weight x grads, summed in float32 at least (float64 stays float64)."""
        if total is None:
            return {name: g.detach().to(torch.promote_types(g.dtype, torch.float32)).mul_(weight)
                    for name, g in grads.items()}
        for name, g in grads.items():
            total[name].add_(g, alpha=weight)
        return total

    def apply_gradients(self, optimizer: torch.optim.Optimizer, params: dict[str, nn.Parameter],
                        grads: dict[str, torch.Tensor], max_norm: float | None) -> float:
        """One optimizer step with `grads`, scaled to a global L2 norm of `max_norm` when they exceed it;
        their norm before. A non-finite gradient raises NonFiniteError with nothing changed."""
        norm = math.sqrt(sum(float(g.double().square().sum()) for g in grads.values()))
        if not math.isfinite(norm):
            raise NonFiniteError(f"the accumulated gradient's norm is {norm}")
        factor = 1.0 if max_norm is None or norm <= max_norm else max_norm / norm
        for name, param in params.items():
            grad = grads.get(name)
            param.grad = None if grad is None else (grad * factor).to(param.dtype)
        try:
            optimizer.step()
        finally:
            optimizer.zero_grad(set_to_none=True)
        return norm

    # -- checkpoints ----------------------------------------------------------------------------
    def checkpoint_tensors(self, learner: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        return checkpoint_tensors(learner)

    def check_restore(self, learner: Any, tensors: dict[str, torch.Tensor], state: dict, source: str) -> dict:
        """The checkpoint's optimizer state, after checking everything it holds against the learner
        (CorruptCheckpointError, so that resume falls back to the previous checkpoint)."""
        for name, param in learner.params.items():
            check_saved_tensor(tensors.get(f"param/{name}"), f"parameter {name!r}", tuple(param.shape), source,
                               dtype=param.dtype)
        for name, buffer in state_buffers(learner.model).items():
            if f"buffer/{name}" in tensors:
                check_saved_tensor(tensors[f"buffer/{name}"], f"buffer {name!r}", tuple(buffer.shape), source,
                                   dtype=buffer.dtype)
        rng = torch.get_rng_state()
        check_saved_tensor(tensors.get("rng/torch"), "the RNG state", tuple(rng.shape), source, dtype=rng.dtype)
        optimizer_state = unflatten_optimizer_state(tensors, state["optimizer"])
        shapes = [tuple(p.shape) for group in learner.optimizer.param_groups for p in group["params"]]
        check_optimizer_state(optimizer_state, learner.optimizer.state_dict(), shapes, source)
        return optimizer_state

    def restore_point(self, learner: Any) -> Any:
        return torch.get_rng_state(), {name: b.clone() for name, b in state_buffers(learner.model).items()}

    def apply_restore(self, learner: Any, tensors: dict[str, torch.Tensor], state: dict, checked: Any) -> None:
        apply_restored(learner, tensors, checked)

    def roll_back_restore(self, learner: Any, point: Any) -> None:
        rng, buffers = point
        torch.set_rng_state(rng)
        with torch.no_grad():
            for name, buffer in state_buffers(learner.model).items():
                buffer.copy_(buffers[name])
