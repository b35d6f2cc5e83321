"""What a subnetwork-DP run is evaluated on: the unified full model (every branch, every channel), the
same with each branch scaled by P/N, each worker's own subnetwork, and the N subnetworks' softmax
ensemble."""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from edgetrain.methods.subnet_dp.plan import SubnetPlan
from edgetrain.methods.subnet_dp.subnetwork import masked_block, masked_forward
from edgetrain.models.resnet import ResNet
from edgetrain.models.resnet_subnet import SubnetResNetConfig


@torch.no_grad()
def evaluate(model: nn.Module, features: torch.Tensor, labels: torch.Tensor, batch_size: int = 256) -> dict[str, float]:
    """Top-1 accuracy and mean cross-entropy of `model` (eval mode) on (features, labels)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    correct, loss = 0, 0.0
    for start in range(0, len(features), batch_size):
        x, y = features[start:start + batch_size].to(device), labels[start:start + batch_size].to(device)
        logits = model(x)
        loss += float(F.cross_entropy(logits, y, reduction="sum"))
        correct += int((logits.argmax(-1) == y).sum())
    model.train(was_training)
    return {"accuracy": correct / len(features), "loss": loss / len(features)}


def unified_branch_scale(plan: SubnetPlan) -> float:
    """Stochastic depth's test-time rule carried over to block masking: each residual branch of the
    unified model is scaled by the fraction of workers that train it, P/N. (Neuron masking needs no
    rule: norm2 renormalises conv2's output whatever the number of hidden channels.)"""
    return plan.overlap / plan.num_workers if plan.kind == "block" else 1.0


@torch.no_grad()
def branch_scaled_logits(model: nn.Module, x: torch.Tensor, branch_scale: float = 1.0) -> torch.Tensor:
    if branch_scale == 1.0:
        return model(x)
    h = model.embed(x)
    for block in model.blocks:
        h = masked_block(block, h, None, branch_scale)
    return model.head(h)


@torch.no_grad()
def evaluate_logits(logits_of: Callable[[torch.Tensor], torch.Tensor], features: torch.Tensor,
                    labels: torch.Tensor, batch_size: int = 256) -> tuple[dict[str, float], torch.Tensor]:
    """Accuracy and mean cross-entropy of a logits function; also returns the softmax probabilities."""
    probs, loss, correct = [], 0.0, 0
    for start in range(0, len(features), batch_size):
        y = labels[start:start + batch_size]
        logits = logits_of(features[start:start + batch_size]).float().cpu()
        loss += float(F.cross_entropy(logits, y, reduction="sum"))
        correct += int((logits.argmax(-1) == y).sum())
        probs.append(logits.softmax(-1))
    return {"accuracy": correct / len(features), "loss": loss / len(features)}, torch.cat(probs)


def accuracy(probs: torch.Tensor, labels: torch.Tensor) -> float:
    return float((probs.argmax(-1) == labels).float().mean())


def build_full_model(model_config: SubnetResNetConfig, state: dict[str, torch.Tensor],
                     device: str | torch.device = "cpu") -> ResNet:
    with torch.device("meta"):
        model = ResNet(model_config)
    model = model.to_empty(device=device)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(state[name])
    return model


@torch.no_grad()
def evaluate_simulated(model: nn.Module, plan: SubnetPlan, test: tuple[torch.Tensor, torch.Tensor]) -> dict[str, Any]:
    """The evaluations of SubnetDPResult for a full model and plan in one process; test_subnetwork is
    the mean over the N workers' subnetworks (masked forwards)."""
    model.eval()
    out: dict[str, Any] = {}
    out["test"], _ = evaluate_logits(model, *test)
    scale = unified_branch_scale(plan)
    out["test_branch_scaled"], _ = evaluate_logits(lambda x: branch_scaled_logits(model, x, scale), *test)
    accuracies, total = [], None
    for worker in range(plan.num_workers):
        metrics, probs = evaluate_logits(lambda x: masked_forward(model, plan, worker, x), *test)
        accuracies.append(metrics["accuracy"])
        total = probs if total is None else total + probs
    out["test_subnetwork"] = {"accuracy": sum(accuracies) / len(accuracies), "per_worker": accuracies}
    out["test_ensemble"] = {"accuracy": accuracy(total, test[1])}
    model.train()
    return out
