"""torch's SGD, Adam and AdamW without torch._dynamo.

torch.optim wraps add_param_group, state_dict, load_state_dict, zero_grad and every step in torch._dynamo's
disable/graph-break hooks, and the first call imports torch._dynamo: about 70 MiB of resident memory a
phone-class device pays for a compiler that edgetrain's eager training never runs. These subclasses keep
torch's classes (constructor checks, param groups, hooks, state_dict format: a checkpoint written by one loads
into the other) and replace only the wrapped methods: the bookkeeping with torch's own undecorated functions,
the step with the same per-tensor arithmetic as torch's single-tensor kernels (the ones torch itself runs on
CPU), so an update is bit-equal to torch's. Options that need torch's other kernels (foreach, fused,
capturable, differentiable, tensor rates, complex or sparse tensors) take torch's own step.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

_Optimizer = torch.optim.Optimizer


def _undecorated(function: Callable) -> Callable:
    # torch._disable_dynamo keeps the plain function as __wrapped__ (functools.wraps); a torch that stops
    # doing so still works, only with the import.
    return getattr(function, "__wrapped__", function)


def _plain_group(group: dict[str, Any]) -> bool:
    """True when torch's own step would take its single-tensor kernel with float hyper-parameters."""
    if group.get("foreach") or group.get("fused") or group.get("capturable") or group.get("differentiable"):
        return False
    numbers = [group["lr"], group.get("weight_decay", 0.0), *group.get("betas", ())]
    if any(isinstance(value, torch.Tensor) for value in numbers):
        return False
    return all(p.grad is None or not (p.grad.is_sparse or torch.is_complex(p)) for p in group["params"])


class EagerStep:
    """torch.optim.Optimizer's bookkeeping without its torch._dynamo wrappers, and the step, one parameter at
    a time through the class's `_update(param, grad, state, group)`, which writes the new values into `param`
    and `state` in place."""

    add_param_group = _undecorated(_Optimizer.add_param_group)
    state_dict = _undecorated(_Optimizer.state_dict)
    load_state_dict = _undecorated(_Optimizer.load_state_dict)
    zero_grad = _undecorated(_Optimizer.zero_grad)

    def plain(self) -> bool:
        """True when step() runs edgetrain's arithmetic (not torch's foreach/fused/... kernels)."""
        return all(_plain_group(group) for group in self.param_groups)

    def step(self, closure: Callable | None = None):
        if not self.plain():
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            for group in self.param_groups:
                for param in group["params"]:
                    if param.grad is not None:
                        self._update(param, param.grad, self.state[param], group)
                        if not self.state[param]:  # stateless (SGD without momentum): torch keeps no entry
                            del self.state[param]
        return loss

    @torch.no_grad()
    def trial_update(self, param: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        """What `param` and its state would be after step(), computed on copies of that one parameter's
        tensors with the same arithmetic (so bit-equal); nothing is changed. Only for plain() groups."""
        group = next(group for group in self.param_groups if any(p is param for p in group["params"]))
        state = {key: value.clone() if isinstance(value, torch.Tensor) else value
                 for key, value in self.state.get(param, {}).items()}
        value = param.detach().clone()
        self._update(value, param.grad, state, group)
        return value, state


class SGD(EagerStep, torch.optim.SGD):
    @staticmethod
    def _update(param: torch.Tensor, grad: torch.Tensor, state: dict, group: dict[str, Any]) -> None:
        # torch.optim.sgd._single_tensor_sgd, operation for operation.
        weight_decay, momentum = group["weight_decay"], group["momentum"]
        grad = grad if not group["maximize"] else -grad
        if weight_decay != 0:
            grad = grad.add(param, alpha=weight_decay)
        if momentum != 0:
            buffer = state.get("momentum_buffer")
            if buffer is None:
                buffer = grad.detach().clone()
            else:
                buffer.mul_(momentum).add_(grad, alpha=1 - group["dampening"])
            state["momentum_buffer"] = buffer
            grad = grad.add(buffer, alpha=momentum) if group["nesterov"] else buffer
        param.add_(grad, alpha=-group["lr"])


class Adam(EagerStep, torch.optim.Adam):
    @staticmethod
    def _update(param: torch.Tensor, grad: torch.Tensor, state: dict, group: dict[str, Any]) -> None:
        # torch.optim.adam._single_tensor_adam (capturable=False, differentiable=False), operation for
        # operation.
        lr, weight_decay, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        if not state:
            state.update(_adam_state(param, group["amsgrad"]))
        grad = grad if not group["maximize"] else -grad
        exp_avg, exp_avg_sq, step_count = state["exp_avg"], state["exp_avg_sq"], state["step"]
        step_count += 1
        if weight_decay != 0:
            if group["decoupled_weight_decay"]:
                param.mul_(1 - lr * weight_decay)
            else:
                grad = grad.add(param, alpha=weight_decay)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        step = step_count.item()
        bias_correction1 = 1 - beta1 ** step
        bias_correction2_sqrt = (1 - beta2 ** step) ** 0.5
        step_size = lr / bias_correction1
        if group["amsgrad"]:
            torch.maximum(state["max_exp_avg_sq"], exp_avg_sq, out=state["max_exp_avg_sq"])
            denom = (state["max_exp_avg_sq"].sqrt() / bias_correction2_sqrt).add_(eps)
        else:
            denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        param.addcdiv_(exp_avg, denom, value=-step_size)


class AdamW(Adam, torch.optim.AdamW):
    """AdamW is Adam with decoupled weight decay (a group flag torch's constructor sets)."""


def _adam_state(param: torch.Tensor, amsgrad: bool) -> dict[str, torch.Tensor]:
    # The keys, dtypes and devices torch.optim.Adam._init_group gives a non-capturable, non-fused group.
    step_dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    state = {"step": torch.tensor(0.0, dtype=step_dtype),
             "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
             "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format)}
    if amsgrad:
        state["max_exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
    return state
