"""Gradient alignment (§5): cos_sim(g_mask, g_unmask) over a worker's active parameters.

g_mask is worker i's gradient under its mask m_i (the subnetwork's gradient, in full coordinates);
g_unmask is the full model's gradient on the same input. Both are restricted to the entries m_i
keeps, per parameter (the paper plots the conv of the second basic block) and over all of the
worker's masked parameters together. A worker that does not hold a parameter has no value for it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from edgetrain.methods.subnet_dp.layout import parameter_role
from edgetrain.methods.subnet_dp.plan import SubnetPlan
from edgetrain.methods.subnet_dp.subnetwork import masked_forward
from edgetrain.training.losses import task_loss

DEFAULT_LAYER = "blocks.1.conv1.weight"  # the first conv of ResNet-18's second BasicBlock


def _grads(model: nn.Module, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = dict(model.named_parameters())
    grads = torch.autograd.grad(loss, [params[n] for n in names], allow_unused=True)
    return {n: torch.zeros_like(params[n]) if g is None else g for n, g in zip(names, grads)}


def gradient_alignment(model: nn.Module, plan: SubnetPlan, worker: int, inputs: torch.Tensor,
                       targets: torch.Tensor, layers: tuple[str, ...] = (DEFAULT_LAYER,)) -> dict[str, float | None]:
    """{"all": cosine over every masked parameter worker holds, layer: cosine over that layer's active
    entries (None if the worker holds none of it)}. The model is left unchanged (no .grad written)."""
    g_mask = _grads(model, task_loss(model, masked_forward(model, plan, worker, inputs), targets))
    g_full = _grads(model, task_loss(model, model(inputs), targets))
    shapes = {n: p.shape for n, p in model.named_parameters()}
    result: dict[str, float | None] = {}
    active_mask, active_full = [], []
    for name, shape in shapes.items():
        if parameter_role(name, plan.kind)[0] == "replicated":
            continue
        keep = plan.parameter_mask(name, shape, worker).to(g_mask[name].device)
        if keep.any():
            active_mask.append(g_mask[name][keep])
            active_full.append(g_full[name][keep])
    result["all"] = _cosine(torch.cat(active_mask), torch.cat(active_full)) if active_mask else None
    for layer in layers:
        keep = plan.parameter_mask(layer, shapes[layer], worker).to(g_mask[layer].device)
        result[layer] = _cosine(g_mask[layer][keep], g_full[layer][keep]) if keep.any() else None
    return result


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(F.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0, eps=1e-30))


def mean_alignment(model: nn.Module, plan: SubnetPlan, inputs: torch.Tensor, targets: torch.Tensor,
                   layer: str = DEFAULT_LAYER) -> dict[str, float | None]:
    """The alignment averaged over the workers (each on the same input), over those that hold `layer`."""
    per_worker = [gradient_alignment(model, plan, w, inputs, targets, (layer,)) for w in range(plan.num_workers)]
    out: dict[str, float | None] = {}
    for key in ("all", layer):
        values = [r[key] for r in per_worker if r[key] is not None]
        out[key] = sum(values) / len(values) if values else None
    return out
