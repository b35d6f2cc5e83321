"""Promises of the tangent bank that mutation testing found unguarded (tools/mutation tangents,
docs/mutation.md): each test here kills mutants of edgetrain/methods/tangents.py that the step-formula
and fgd tests let survive. Named after the promise, not the mutant."""
from __future__ import annotations

import math

import pytest
import torch

import edgetrain
from edgetrain.methods.asyncfgd import AsyncFGD
from edgetrain.methods.base import NonFiniteError
from edgetrain.methods.fgd import ForwardGradient
from edgetrain.methods.tangents import TangentBank, TangentKey, draw_tangent, mix_seed, resolve_alpha
from edgetrain.registry import EdgetrainError
from float64_mlp import feature_batches, mlp_float64

pytestmark = pytest.mark.usefixtures("one_thread")

NAMES = ["blocks.0.linear.weight", "blocks.0.linear.bias", "blocks.1.linear.weight", "blocks.1.linear.bias",
         "head.weight", "head.bias"]


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def kept_bank(checkpoint: bool) -> tuple[TangentBank, dict[str, torch.Tensor]]:
    params = {"w": torch.zeros(4, 3, dtype=torch.float64), "b": torch.zeros(5, dtype=torch.float64)}
    return TangentBank({"w": 0, "b": 1}, {"w": 1.0, "b": 0.5}, checkpoint=checkpoint), params


# -- seeds and draws -----------------------------------------------------------------------------------

def test_mixed_seeds_are_spread_over_the_whole_63_bit_range():
    # mix_seed promises "a 63-bit seed": a non-negative value below 2**63 (what a signed 64-bit
    # seed, an int64 tensor or a checkpoint's metadata can hold) for any integer key, negative
    # and huge parts included, and spread over all 63 bits (about half the seeds have bit 62 set).
    keys = [(seed, sample, module, draw, index) for seed in (0, -1, 2**40 + 7) for sample in range(32)
            for module in range(2) for draw in range(2) for index in (0, 5)]
    seeds = [mix_seed(*key) for key in keys]
    assert all(0 <= s < 2**63 for s in seeds)
    top = sum(s >> 62 for s in seeds) / len(seeds)
    assert 0.4 < top < 0.6, top
    assert len(set(seeds)) == len(seeds)


def test_a_key_without_a_draw_is_the_first_tangent_of_a_step():
    # TangentKey(seed, sample, module) is how a caller names the tangent of a one-tangent step;
    # it must be the tangent fgd used (draw 0), or tangents reproduced from keys would be others.
    assert TangentKey(3, 1, 0) == TangentKey(3, 1, 0, 0)
    model = mlp_float64()
    method = ForwardGradient(model, seed=3, tangent_checkpoint=False)
    method.loss_and_derivatives(feature_batches(1)[0], 1)
    used = {name: t.clone() for (_, name), t in method.bank._kept.items()}
    assert set(used) == set(NAMES)
    for index, (name, param) in enumerate(model.named_parameters()):
        assert torch.equal(used[name], draw_tangent(param, TangentKey(3, 1, 0).parameter_seed(index))), name


@pytest.mark.parametrize("alpha", [0.0, 0.3, 1.0, 2.0])
def test_draw_tangent_is_alpha_times_the_unit_gaussian_draw(alpha: float):
    # draw_tangent is the public way to reproduce a step's tangent (the step-formula tests use it so):
    # its docstring promises alpha * N(0, I) from the seed, so alpha 0 is all zeros and alpha 1 the
    # unit draw itself. edgetrain's own alphas lie in [0, 1]; the function takes any scale.
    like = torch.empty(7, 3, dtype=torch.float64)
    unit = draw_tangent(like, 1234)
    assert unit.abs().min() > 0 and unit.dtype == torch.float64 and unit.shape == like.shape
    scaled = draw_tangent(like, 1234, alpha)
    assert torch.equal(scaled, alpha * unit)
    assert bool((scaled == 0).all()) == (alpha == 0.0)


# -- alpha ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec", [{"head": "0.5"}, {"head": True}, {"head": None}, {0: 0.5}, {None: 0.5},
                                  {("head",): 1.0}])
def test_an_alpha_mapping_must_map_string_prefixes_to_numbers(spec: dict):
    # A malformed alpha is the user's mistake and must be refused with edgetrain's own error naming
    # the entry -- not a TypeError or ValueError from deep inside, and not silently accepted (a bool
    # is not a scale).
    with pytest.raises(EdgetrainError, match="alpha maps parameter-name prefixes"):
        resolve_alpha(spec, NAMES)
    with pytest.raises(EdgetrainError, match="fgd: alpha"):
        ForwardGradient(mlp_float64(), alpha=spec)


@pytest.mark.parametrize("spec", [-0.5, -1.0, 1.5, math.nan, {"head": -0.25}, {"": 0.5, "blocks.1": -1.0}])
def test_alpha_outside_zero_to_one_is_refused(spec):
    # alpha scales tangents in [0, 1] (0 freezes); a negative or larger scale is a mistake, refused.
    with pytest.raises(EdgetrainError, match=r"must be in \[0, 1\]"):
        resolve_alpha(spec, NAMES)


def test_parameters_no_alpha_prefix_matches_get_alpha_one():
    # resolve_alpha's docstring: without a "" entry the default is 1.0, so freezing one group leaves
    # every other parameter at the plain forward-gradient scale (not a larger, unvalidated one).
    assert resolve_alpha({"blocks.0": 0.0, "head.bias": 0.5}, NAMES) == {
        "blocks.0.linear.weight": 0.0, "blocks.0.linear.bias": 0.0, "blocks.1.linear.weight": 1.0,
        "blocks.1.linear.bias": 1.0, "head.weight": 1.0, "head.bias": 0.5}
    method = ForwardGradient(mlp_float64(), alpha={"blocks.0": 0.5})
    assert method.bank.alpha["head.weight"] == 1.0 and method.bank.alpha["blocks.0.linear.bias"] == 0.5


def test_frozen_parameters_get_no_gradient_so_momentum_and_weight_decay_leave_them_alone():
    # alpha = 0 freezes a group. Through a general optimizer that means .grad stays None for it
    # (a zero gradient would not do: weight decay and momentum move a parameter whose .grad is
    # zeros), and the estimate leaves it out.
    model = mlp_float64()
    learner = edgetrain.Learner(model, method="fgd", optimizer="sgd", lr=0.05, probe=False,
                                optimizer_options={"momentum": 0.9, "weight_decay": 0.1},
                                method_options={"seed": 2, "alpha": {"blocks.0": 0.0}})
    assert learner.method.bank.perturbed("head.weight") and not learner.method.bank.perturbed("blocks.0.linear.bias")
    before = weights(model)
    batches = feature_batches(3)
    assert set(learner.method.stage.estimate(0, learner.method.loss_and_derivatives(batches[0], 0)[1])) == \
        set(NAMES[2:])
    for batch in batches:
        learner.step(batch)
    for name, param in model.named_parameters():
        if name.startswith("blocks.0."):
            assert torch.equal(param, before[name]), f"{name} has alpha 0 but moved"
        else:
            assert not torch.equal(param, before[name]), name


# -- the store: tangent checkpointing on and off --------------------------------------------------------

def test_a_tangent_bank_keeps_nothing_by_default():
    # The class docstring: checkpoint=True is the default -- tangents are redrawn from their keys and
    # never stored (the memory saving that tangent checkpointing exists for).
    bank = TangentBank({"w": 0}, {"w": 1.0})
    like = torch.zeros(4, 3, dtype=torch.float64)
    key = TangentKey(0, 2, 0)
    forward = bank.for_forward(key, "w", like).clone()
    assert bank.kept_tensors() == [] and bank.kept_bytes() == 0
    assert torch.equal(bank.for_update(key, "w", like), forward)


def test_kept_bytes_is_the_size_of_the_kept_tangents():
    # Without tangent checkpointing the bank holds each forward's tangents until their update; the
    # memory comparison reads their size from it: num_tangents x every trainable parameter, in bytes.
    model = mlp_float64()
    method = ForwardGradient(model, seed=1, num_tangents=2, tangent_checkpoint=False)
    method.loss_and_derivatives(feature_batches(1)[0], 0)
    expected = 2 * sum(p.numel() * 8 for p in model.parameters())  # float64
    assert method.bank.kept_bytes() == expected == sum(t.numel() * t.element_size() for t in method.bank.kept_tensors())
    assert not any(t.requires_grad or t.grad_fn is not None for t in method.bank.kept_tensors())


def test_an_update_without_its_forward_is_refused_with_an_edgetrain_error():
    # Without tangent checkpointing the update can only use a kept tangent; asking for one that no
    # forward kept is refused with edgetrain's error saying so (not a bare KeyError). Checking an
    # update (consume=False) leaves the tangent kept for the update itself.
    bank, params = kept_bank(checkpoint=False)
    key = TangentKey(0, 4, 0)
    with pytest.raises(EdgetrainError, match="no kept tangent for w .*was its forward run"):
        bank.for_update(key, "w", params["w"])
    forward = bank.for_forward(key, "w", params["w"]).clone()
    assert torch.equal(bank.for_update(key, "w", params["w"], consume=False), forward)
    assert torch.equal(bank.for_update(key, "w", params["w"]), forward)
    with pytest.raises(EdgetrainError, match="was its forward run"):
        bank.for_update(key, "w", params["w"], consume=False)


def test_releasing_a_stopped_steps_tangents_drops_exactly_those():
    # A step that stops before its update must not leave its kept tangents behind (they would pile
    # up, one parameter-sized tensor per parameter per failed sample), and must not drop the
    # tangents of other samples still in flight (their updates need them).
    bank, params = kept_bank(checkpoint=False)
    stopped, in_flight = TangentKey(0, 1, 0), TangentKey(0, 2, 0)
    for key in (stopped, in_flight):
        for name, like in params.items():
            bank.for_forward(key, name, like)
    bank.release(stopped)
    assert sorted((key.sample, name) for key, name in bank._kept) == [(2, "b"), (2, "w")]
    bank.release(in_flight)
    assert bank.kept_bytes() == 0

    # The same through fgd: a step refused for a non-finite loss keeps nothing.
    model = mlp_float64()
    method = ForwardGradient(model, seed=1, tangent_checkpoint=False)
    bad = feature_batches(1)[0]
    bad.inputs[0, 0] = float("nan")
    with pytest.raises(NonFiniteError):
        method.step(bad, torch.optim.SGD(model.parameters(), lr=0.05))
    assert method.bank.kept_tensors() == []


@pytest.mark.parametrize("checkpoint", [True, False])
def test_a_resumed_pipeline_redraws_kept_tangents_only_without_tangent_checkpointing(checkpoint: bool):
    # Resuming AsyncFGD mid-pipeline refills the bank (keep_again): without tangent checkpointing the
    # in-flight samples' tangents are state and must be drawn again, bit for bit, so the run continues
    # exactly; with it nothing may be stored, on resume as at any other time.
    def pipeline(model: torch.nn.Module) -> tuple[AsyncFGD, torch.optim.SGD]:
        return (AsyncFGD(model, num_modules=3, runtime="reference", seed=5, tangent_checkpoint=checkpoint),
                torch.optim.SGD(model.parameters(), lr=0.05))

    batches = feature_batches(6)
    straight_model = mlp_float64()
    straight, optimizer = pipeline(straight_model)
    for batch in batches:
        straight.step(batch, optimizer)

    first_model = mlp_float64()
    first, optimizer = pipeline(first_model)
    for batch in batches[:3]:
        first.step(batch, optimizer)
    resumed_model = mlp_float64()
    resumed_model.load_state_dict(first_model.state_dict())
    resumed, optimizer = pipeline(resumed_model)
    resumed.load_state_dict(first.state_dict())
    if checkpoint:
        assert resumed.bank.kept_tensors() == []
    else:
        assert resumed.bank.kept_bytes() == first.bank.kept_bytes() > 0
        assert all(torch.equal(t, first.bank._kept[k]) for k, t in resumed.bank._kept.items())
    for batch in batches[3:]:
        resumed.step(batch, optimizer)
    assert all(torch.equal(a, b) for a, b in zip(weights(straight_model).values(), weights(resumed_model).values()))
    assert (resumed.bank.kept_bytes() == 0) == checkpoint
