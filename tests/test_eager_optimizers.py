"""edgetrain's optimizers by name are torch's SGD, Adam and AdamW without the torch._dynamo import (70 MiB on
the user's device): bit-equal updates and state_dicts, checkpoints that move between the two, torch's own
step for options it alone runs, an all-or-nothing step checked on a copy one parameter at a time."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from edgetrain.backends.torch import eager_optimizers
from edgetrain.backends.torch.finite_steps import FiniteOptimizerSteps
from edgetrain.backends.torch.optimizers import make_optimizer
from edgetrain.methods.base import NonFiniteError

CASES = [("SGD", {}), ("SGD", {"momentum": 0.9, "nesterov": True, "weight_decay": 0.1}),
         ("SGD", {"momentum": 0.9, "dampening": 0.2, "maximize": True}),
         ("Adam", {}), ("Adam", {"weight_decay": 0.1, "amsgrad": True}), ("AdamW", {}),
         ("AdamW", {"amsgrad": True, "maximize": True, "betas": (0.8, 0.95), "eps": 1e-6}),
         ("AdamW", {"foreach": True})]  # torch's own multi-tensor step


def _params() -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(6, 5, generator=generator)),
            torch.nn.Parameter(torch.randn(5, generator=generator))]


def _gradients(step: int, params: list[torch.nn.Parameter]) -> None:
    generator = torch.Generator().manual_seed(100 + step)
    for index, param in enumerate(params):
        # the second parameter sits out step 2: no .grad, no update, no state change
        param.grad = None if (step == 2 and index == 1) else torch.randn(param.shape, generator=generator)


def _run(optimizer_class, options: dict, steps: int = 5, start: dict | None = None):
    params = _params()
    optimizer = optimizer_class(params, lr=0.01, **options)
    if start is not None:
        optimizer.load_state_dict(start)
    for step in range(steps):
        _gradients(step, params)
        optimizer.step()
        optimizer.zero_grad()
    return params, optimizer


def _same_state(ours: dict, theirs: dict) -> bool:
    if ours["param_groups"] != theirs["param_groups"] or ours["state"].keys() != theirs["state"].keys():
        return False
    return all(a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
               for a, b in ((ours["state"][i], theirs["state"][i]) for i in ours["state"]))


@pytest.mark.parametrize("name, options", CASES)
def test_each_update_and_state_equals_torchs_bit_for_bit(name, options):
    ours, our_optimizer = _run(getattr(eager_optimizers, name), options)
    theirs, their_optimizer = _run(getattr(torch.optim, name), options)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    assert _same_state(our_optimizer.state_dict(), their_optimizer.state_dict())
    assert isinstance(our_optimizer, getattr(torch.optim, name))


@pytest.mark.parametrize("name, options", CASES[:7])
def test_a_checkpoint_of_either_resumes_in_the_other(name, options):
    _, torch_optimizer = _run(getattr(torch.optim, name), options, steps=3)
    _, our_optimizer = _run(getattr(eager_optimizers, name), options, steps=3)
    resumed_ours, _ = _run(getattr(eager_optimizers, name), options, start=torch_optimizer.state_dict())
    resumed_torch, _ = _run(getattr(torch.optim, name), options, start=our_optimizer.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(resumed_ours, resumed_torch))


@pytest.mark.parametrize("name, options", CASES[:7])
def test_a_trial_update_is_the_step_and_changes_nothing(name, options):
    params = _params()
    optimizer = getattr(eager_optimizers, name)(params, lr=0.01, **options)
    for step in range(3):
        _gradients(step, params)
        before = [p.detach().clone() for p in params]
        state_before = {k: v.clone() for k, v in optimizer.state_dict()["state"].get(0, {}).items()}
        trials = [(p, optimizer.trial_update(p)) for p in params if p.grad is not None]
        assert all(torch.equal(a, b) for a, b in zip(params, before))
        assert all(torch.equal(v, optimizer.state_dict()["state"][0][k]) for k, v in state_before.items())
        optimizer.step()
        for param, (value, state) in trials:
            assert torch.equal(value, param)
            assert all(torch.equal(v, optimizer.state[param][k]) for k, v in state.items()
                       if isinstance(v, torch.Tensor))


def _guarded(optimizer_class, **options):
    params = _params()
    optimizer = optimizer_class(params, lr=0.01, **options)
    FiniteOptimizerSteps(optimizer, {f"p{i}": p for i, p in enumerate(params)})
    _gradients(0, params)
    optimizer.step()
    return params, optimizer


@pytest.mark.parametrize("optimizer_class", [eager_optimizers.AdamW, torch.optim.AdamW])
def test_a_step_whose_second_moment_overflows_changes_nothing(optimizer_class):
    """grad**2 past float32's range: the weight would stay finite (the update divides by inf) while Adam's
    second moment turns inf and freezes it for good. Refused whole, on edgetrain's trial path and on
    torch's own optimizer (copied and put back)."""
    params, optimizer = _guarded(optimizer_class)
    weights = [p.detach().clone() for p in params]
    state = {id(p): {k: v.clone() for k, v in optimizer.state[p].items()} for p in params}
    for bad in (0, 1):  # the one named is the one that overflows, wherever it sits
        params[bad].grad = torch.full_like(params[bad], 1e30)
        params[1 - bad].grad = torch.ones_like(params[1 - bad])
        with pytest.raises(NonFiniteError, match=rf"AdamW: the update of p{bad} came out non-finite"):
            optimizer.step()
        assert all(torch.equal(a, b) for a, b in zip(params, weights))
        for param in params:
            assert all(torch.equal(optimizer.state[param][k], v) for k, v in state[id(param)].items())


def test_the_trial_path_keeps_no_copy_of_the_weights(monkeypatch):
    """The all-or-nothing check of edgetrain's optimizers tries one parameter at a time: the snapshot
    of every stepped weight and its state (three adapter-sized copies for Adam) is never taken."""
    from edgetrain.backends.torch import finite_steps

    monkeypatch.setattr(finite_steps, "_copy_state", lambda state: pytest.fail("the state was copied whole"))
    params, optimizer = _guarded(eager_optimizers.Adam)
    assert optimizer.state[params[0]]["step"] == 1


def test_optimizers_by_name_are_edgetrains_and_import_no_dynamo():
    code = ("import sys, torch\n"
            "from edgetrain.backends.torch.optimizers import make_optimizer\n"
            "p = torch.nn.Parameter(torch.ones(3))\n"
            "for name in ('sgd', 'adam', 'adamw'):\n"
            "    o = make_optimizer(name, [p], 0.1); p.grad = torch.ones(3); o.step(); o.zero_grad()\n"
            "    o.load_state_dict(o.state_dict())\n"
            "print('torch._dynamo' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr[-2000:]
    for name, expected in (("sgd", eager_optimizers.SGD), ("adam", eager_optimizers.Adam),
                           ("adamw", eager_optimizers.AdamW)):
        assert type(make_optimizer(name, _params(), 0.1)) is expected


def test_one_reading_tells_whether_every_tensor_is_finite():
    """all_finite: each tensor's largest magnitude, stacked; NaN and either infinity anywhere, in any float
    dtype, make it False; empty and integer tensors are finite."""
    from edgetrain.backends.torch.finite_steps import all_finite

    clean = [torch.randn(3, 4), torch.ones(5, dtype=torch.float16), torch.zeros(2, dtype=torch.bfloat16),
             torch.empty(0), torch.arange(4), torch.randn(2, dtype=torch.float64)]
    assert all_finite(clean) and all_finite([])
    for bad in (float("nan"), float("inf"), -float("inf")):
        for index in (0, 1, 2, 5):
            tensors = [t.clone() for t in clean]
            tensors[index].view(-1)[-1] = bad
            assert not all_finite(tensors), (bad, index)
    overflowed = torch.tensor([60000.0], dtype=torch.float16) * 2  # inf in float16
    assert not all_finite([torch.ones(3), overflowed])
