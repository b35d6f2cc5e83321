"""`subnet_dp` as a single-process training method: N workers simulated on one full model.

    learner = Learner(build_subnet_resnet(digits_subnet_config()), method="subnet_dp",
                      method_options={"num_workers": 4, "overlap": 2, "masking": "block"},
                      optimizer="sgd", lr=0.05, optimizer_options={"momentum": 0.9, "nesterov": True})

Each step cuts the batch into N equal shards; worker i's loss is the full model's forward with its
mask m_i applied (subnetwork.masked_forward), and the update uses sum_i m_i * g_i / (owner count) --
exactly the distributed run's averaged gradient for the same global batch (tested equal). It saves
no memory (the full model, and one gradient per worker in turn, live in this process); the real
method is the torchrun trainer (edgetrain.recipes.subnet_dp.trainer / .run). This is for
experiments on one machine, the diagnostics of §5, and checking the distributed engine.

Options and their defaults: num_workers 4, overlap (P) 2, masking "block", mask_seed 0, load_slack None
(the plan's own). A checkpoint resumes only into a learner with the same options.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from edgetrain.data.batch import Batch
from edgetrain.methods.base import METHODS, TrainingError, apply_gradients, trainable_parameters
from edgetrain.methods.options import positive_int_option
from edgetrain.methods.subnet_dp.assign import assign_masks
from edgetrain.methods.subnet_dp.subnetwork import masked_forward
from edgetrain.training.losses import task_loss


class SubnetDPSimulation:
    name = "subnet_dp"

    def __init__(self, model: nn.Module, num_workers: int = 4, overlap: int = 2, masking: str = "block",
                 mask_seed: int = 0, load_slack: float | None = None) -> None:
        for name, value in (("num_workers", num_workers), ("overlap", overlap)):
            positive_int_option("subnet_dp", name, value)
        if isinstance(mask_seed, bool) or not isinstance(mask_seed, int):
            raise TrainingError(f"subnet_dp: mask_seed must be an integer, got {mask_seed!r}")
        self.model = model
        self.options = {"num_workers": num_workers, "overlap": overlap, "masking": masking, "mask_seed": mask_seed,
                        "load_slack": load_slack}
        self.plan = assign_masks(model, masking, num_workers, overlap, mask_seed, load_slack=load_slack)
        self.params = trainable_parameters(model)
        if len(self.params) != len(list(model.parameters())):
            raise TrainingError("subnet_dp trains every parameter of the ResNet; frozen parameters are not supported")
        self._masks = [self.plan.parameter_masks(model, worker) for worker in range(num_workers)]

    def shards(self, batch: Batch) -> list[tuple[torch.Tensor, torch.Tensor]]:
        n = self.plan.num_workers
        if batch.num_samples % n:
            raise TrainingError(f"subnet_dp with N={n} workers needs a batch divisible by N; got {batch.num_samples}")
        size = batch.num_samples // n
        return [(batch.inputs[i * size:(i + 1) * size], batch.targets[i * size:(i + 1) * size]) for i in range(n)]

    def worker_gradient(self, worker: int, inputs: torch.Tensor, targets: torch.Tensor
                        ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Worker `worker`'s loss and gradient in full coordinates (zero outside m_i)."""
        loss = task_loss(self.model, masked_forward(self.model, self.plan, worker, inputs), targets)
        names = list(self.params)
        grads = torch.autograd.grad(loss, [self.params[n] for n in names], allow_unused=True)
        out = {}
        for name, grad in zip(names, grads):
            mask = self._masks[worker][name].to(self.params[name].device)
            out[name] = torch.zeros_like(self.params[name]) if grad is None else grad * mask
        return loss.detach(), out

    def gradients(self, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        total = {name: torch.zeros_like(p) for name, p in self.params.items()}
        losses = []
        for worker, (inputs, targets) in enumerate(self.shards(batch)):
            loss, grads = self.worker_gradient(worker, inputs, targets)
            losses.append(loss)
            for name, grad in grads.items():
                total[name] += grad
        for name in total:
            total[name] /= self.plan.owner_count(name)  # P (or N on the trunk), never the non-zero senders
        return torch.stack(losses).mean(), total

    def step(self, batch: Batch, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        loss, grads = self.gradients(batch)
        apply_gradients(self.params, grads, optimizer)
        return loss

    def state_dict(self) -> dict[str, Any]:
        return dict(self.options)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if {k: state.get(k) for k in self.options} != self.options:
            raise TrainingError(f"checkpoint was written by subnet_dp with {state}; this learner has {self.options}")


if "subnet_dp" not in METHODS:
    METHODS.add("subnet_dp", SubnetDPSimulation)
