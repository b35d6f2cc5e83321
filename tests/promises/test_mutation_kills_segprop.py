"""Promises of SegProp's stage logic that mutation testing found unguarded (tools/mutation segprop,
docs/mutation.md): each test here kills mutants of edgetrain/methods/segprop/trainer.py that every other
test let survive. Named after the promise, not the mutant.

The model is the float64 Tanh MLP of test_step_formula_segprop.py: units blocks.0 .. blocks.3 and
head = Linear; head_blocks=1 makes blocks.3 + head the global head, segments=3 cuts the body into
blocks.0 | blocks.1 | blocks.2 (stages 0 and 1 reach the head through an adapter); the train()/eval()
test uses a small BatchNorm ResNet instead. Driven through the Learner (or the method's own
step(batch, optimizer)) with SGD, so an update is p - rate * gradient; lr 0 keeps every batch's loss
fixed where a test needs to choose the sequence of losses the plateau tracker sees."""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import edgetrain
from edgetrain.data.batch import Batch
from edgetrain.methods.base import NonFiniteError
from edgetrain.methods.segprop.schedule import cosine_multiplier
from edgetrain.registry import EdgetrainError
import float64_mlp
from float64_mlp import feature_batches

# One intra-op thread (tests/conftest.py: fixed reduction order, no OpenMP spinning).
pytestmark = pytest.mark.usefixtures("one_thread")

LR = 0.1
HEAD = ("blocks.3.", "head.")


def mlp_float64() -> nn.Module:
    return float64_mlp.mlp_float64((6, 5, 7, 6))


def segprop_learner(lr: float = LR, **options) -> edgetrain.Learner:
    return edgetrain.Learner(mlp_float64(), method="segprop", optimizer="sgd", lr=lr, probe=False,
                             method_options={"head_blocks": 1, "segments": 3, **options})


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def stage0_gradient(model: nn.Module, batch: Batch) -> dict[str, torch.Tensor]:
    """d(stage-0 loss)/d(blocks.0, adapter 0, blocks.3, head), on a copy: embed -> blocks.0 -> adapter ->
    blocks.3 -> head, the task loss in the model's precision (float64 here) as in edgetrain/training/losses.py."""
    reference = copy.deepcopy(model)
    for param in reference.parameters():
        param.requires_grad_(True)
    path = [reference.embed, reference.blocks[0], reference.stage_adapters["0"], reference.blocks[3],
            reference.head]
    h = batch.inputs
    for module in path:
        h = module(h)
    trained = {id(p) for module in path for p in module.parameters()}
    params = {name: p for name, p in reference.named_parameters() if id(p) in trained}
    loss = F.cross_entropy(h, batch.targets)
    return dict(zip(params, torch.autograd.grad(loss, list(params.values()))))


# -- the update rule -----------------------------------------------------------------------------------

@pytest.mark.parametrize("scale", [0.5, 2.0, 0.0])
def test_global_head_trains_at_its_own_scaled_rate(scale):
    """head_lr_scale: the segment (its units and adapter) steps at lr, the global head at lr * scale
    (0: the head keeps its weights), both from the one stage loss of the step."""
    learner = segprop_learner(head_lr_scale=scale)
    model, batch = learner.model, feature_batches(2)[0]
    learner.step(feature_batches(1, seed=1)[0])   # applies stage 0 (the adapter joins the model)
    before, grads = weights(model), stage0_gradient(model, batch)
    assert {n for n in grads} == {n for n in before if n.startswith(("blocks.0.", "stage_adapters.0.", *HEAD))}
    learner.step(batch)
    for name, param in model.named_parameters():
        if name not in grads:
            assert torch.equal(param, before[name]), name
            continue
        rate = LR * scale if name.startswith(HEAD) else LR
        assert grads[name].abs().max() > 0, name
        torch.testing.assert_close(param.detach(), before[name] - rate * grads[name], rtol=1e-12, atol=1e-15,
                                   msg=lambda text: f"{name}: {text}")


def test_cosine_schedule_follows_eq_f1_between_warmup_and_end():
    """Paper Eq. F.1 after the warm-up: floor + (1 - floor) / 2 * (1 + cos(pi * (t - W) / (T - W))) up to
    step T, and floor after it (steps past the end of the schedule)."""
    for total, warmup, floor in ((10, 0, 0.0), (10, 2, 0.1), (7, 3, 0.25), (4, 3, 0.2)):
        for step in range(warmup, total + 1):
            expected = floor + 0.5 * (1 - floor) * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))
            assert cosine_multiplier(step, total, warmup, floor) == pytest.approx(expected, rel=1e-12, abs=1e-15)
        for step in range(total + 1, 2 * total + 2):   # "and `floor` after it"
            assert cosine_multiplier(step, total, warmup, floor) == pytest.approx(floor, rel=1e-12, abs=1e-15)
    assert cosine_multiplier(5, 10, 0, 0.0) == pytest.approx(0.5)


def test_compute_gradients_gives_the_stage_loss_gradient_of_exactly_the_trained_parameters():
    """Learner.compute_gradients (the method's gradients()): d(stage loss)/d(every parameter the stage
    trains), no update -- a stale .grad on the model (the user's own backward) is ignored, not added."""
    model, batch = mlp_float64(), feature_batches(1)[0]
    F.cross_entropy(model(batch.inputs).float(), batch.targets).backward()
    learner = edgetrain.Learner(model, method="segprop", optimizer="sgd", lr=LR, probe=False,
                                method_options={"head_blocks": 1, "segments": 3})
    assert model.head.weight.grad is not None
    before, expected = weights(model), stage0_gradient(model, batch)
    loss, grads = learner.compute_gradients(batch)
    assert set(grads) == set(expected)
    for name, grad in grads.items():
        assert expected[name].abs().max() > 0, name
        torch.testing.assert_close(grad, expected[name], rtol=1e-12, atol=1e-15, msg=lambda text: f"{name}: {text}")
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert all(p.grad is None for n, p in model.named_parameters() if n in expected)   # none of its own left


def test_parameters_frozen_before_the_method_are_neither_trained_nor_reported():
    """Only parameters that were trainable when the method was built ever train: with head.bias and
    blocks.3's weight frozen beforehand, compute_gradients reports the rest of the stage's parameters
    and a step (the head at its own rate) leaves the frozen ones as they were."""
    model, batch = mlp_float64(), feature_batches(1)[0]
    frozen = {"head.bias", "blocks.3.linear.weight"}
    for name, param in model.named_parameters():
        param.requires_grad_(name not in frozen)
    learner = edgetrain.Learner(model, method="segprop", optimizer="sgd", lr=LR, probe=False,
                                method_options={"head_blocks": 1, "segments": 3, "head_lr_scale": 0.5})
    _, grads = learner.compute_gradients(batch)
    assert set(grads) == set(stage0_gradient(model, batch)) - frozen
    before = weights(model)
    learner.step(batch)
    assert all(torch.equal(dict(model.named_parameters())[n], before[n]) for n in frozen)
    assert all(not torch.equal(p, before[n]) for n, p in model.named_parameters() if n in grads)


@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_segprop_keeps_no_gradient_buffers_between_steps(scale):
    """Between steps (and across stage changes) only weights and optimizer state are held: no .grad is
    left on any parameter, whether the head steps at the segment's rate or at its own."""
    learner = segprop_learner(steps_per_stage=1, head_lr_scale=scale)
    for batch in feature_batches(3):
        learner.step(batch)
        assert all(p.grad is None for p in learner.model.parameters())
    assert learner.method.finished


def test_a_stale_gradient_on_the_model_moves_no_frozen_parameter():
    """A .grad left on every parameter before the method was built (a backward of the user's own):
    the first step drops it, so AdamW's weight decay touches only what stage 0 trains, and the optimizer
    keeps state only for those parameters."""
    model, batch = mlp_float64(), feature_batches(1)[0]
    F.cross_entropy(model(batch.inputs).float(), batch.targets).backward()
    assert all(p.grad is not None for p in model.parameters())
    learner = edgetrain.Learner(model, method="segprop", optimizer="adamw", lr=1e-2, probe=False,
                                method_options={"head_blocks": 1, "segments": 3})
    assert learner.optimizer.param_groups[0]["weight_decay"] > 0
    before = weights(model)
    learner.step(batch)
    trained = ("blocks.0.", "stage_adapters.0.", *HEAD)
    for name, param in model.named_parameters():
        if not name.startswith(trained):
            assert torch.equal(param, before[name]), f"{name} is frozen in stage 0 but changed"
    state = {n for n, p in model.named_parameters() if p in learner.optimizer.state}
    assert state and all(n.startswith(trained) for n in state)


# -- errors leave the state untouched --------------------------------------------------------------------

def test_a_non_finite_gradient_changes_no_weight_even_when_the_head_steps_at_another_rate():
    """A NaN in the global head's gradient: the step raises (TrainingError from the Learner,
    NonFiniteError from the method itself) before the segment's sub-step, so no weight moves."""
    learner = segprop_learner(head_lr_scale=0.5)
    model, batches = learner.model, feature_batches(3)
    learner.step(batches[0])
    model.head.weight.register_hook(lambda grad: grad * float("nan"))
    before = weights(model)
    with pytest.raises(EdgetrainError, match="non-finite gradient"):
        learner.step(batches[1])
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert all(p.grad is None for p in model.parameters())
    # The method's own protocol, with a bare optimizer (no Learner step hooks): the refused step leaves
    # no gradient behind, so the caller's next optimizer.step() (weight decay included) moves nothing.
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, weight_decay=0.1)
    with pytest.raises(NonFiniteError, match="non-finite gradient"):
        learner.method.step(batches[2], optimizer)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert all(p.grad is None for p in model.parameters())
    optimizer.step()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


# -- plateau ---------------------------------------------------------------------------------------------

def batches_by_loss(learner: edgetrain.Learner, count: int) -> list[Batch]:
    """`count` batches, sorted by their stage-0 loss at the current weights (lowest first)."""
    batches = feature_batches(count, seed=3)
    losses = [float(learner.method.gradients(b)[0]) for b in batches]
    assert len(set(losses)) == count
    return [b for _, b in sorted(zip(losses, batches), key=lambda pair: pair[0])]


def test_plateau_patience_counts_windows_without_improvement_since_the_last_improvement():
    """plateau_window=1, plateau_patience=2, lr 0 (every batch keeps its loss): losses medium, high (no
    improvement: 1), lowest (an improvement resets the count), high (1 again): the stage goes on."""
    learner = segprop_learner(lr=0.0, plateau_window=1, plateau_patience=2)
    low, medium, high, highest = batches_by_loss(learner, 4)
    for batch in (medium, highest, low, high):
        learner.step(batch)
    assert learner.method.stage_index == 0
    learner.step(highest)   # the second window in a row without improvement
    assert learner.method.stage_index == 1


@pytest.mark.parametrize("targets", ["predicted", "least likely"])
def test_every_plateau_window_holds_exactly_plateau_window_steps(targets):
    """window 2, patience 1, one batch at lr 0 (the same loss every step): the first window is steps 1-2,
    the second (no improvement) steps 3-4, which ends the stage -- whatever the size of the loss (the
    head scaled up: about 0.1 for the predicted classes as targets, about 5 for the least likely)."""
    learner = segprop_learner(lr=0.0, plateau_window=2, plateau_patience=1)
    with torch.no_grad():
        learner.model.head.weight.mul_(30)
    inputs = feature_batches(1)[0].inputs
    logits = learner.method.path_forward(inputs)
    batch = Batch(inputs, logits.argmax(1) if targets == "predicted" else logits.argmin(1), 0)
    loss = float(learner.method.gradients(batch)[0])
    assert loss < 0.5 if targets == "predicted" else loss > 2.5
    for _ in range(3):
        learner.step(batch)
    assert learner.method.stage_index == 0
    learner.step(batch)
    assert learner.method.stage_index == 1


def test_an_equal_window_loss_is_no_improvement_even_with_plateau_min_delta_zero():
    """plateau_min_delta=0: a window must be strictly better than the best; the same loss again (one
    batch at lr 0, window 1, patience 1) ends the stage on the second step."""
    learner = segprop_learner(lr=0.0, plateau_window=1, plateau_patience=1, plateau_min_delta=0.0)
    batch = feature_batches(1)[0]
    learner.step(batch)
    assert learner.method.stage_index == 0
    learner.step(batch)
    assert learner.method.stage_index == 1


def test_a_method_state_without_a_plateau_tracker_resumes_with_a_fresh_one():
    """load_state_dict of a state with only stage and step counts (no "finished", no "plateau"): the
    schedule is not finished and the stage's plateau detection starts as in a fresh stage. Window 2,
    patience 1, one batch at lr 0: the stage ends after two windows; window 1, patience 1, losses high,
    low, low: the stage ends on the third step."""
    def resumed(**options) -> edgetrain.Learner:
        learner = segprop_learner(lr=0.0, **options)
        state = learner.method.state_dict()
        del state["plateau"], state["finished"]
        learner.method.load_state_dict(state)
        assert not learner.method.finished
        return learner

    learner, batch = resumed(plateau_window=2, plateau_patience=1), feature_batches(1)[0]
    for _ in range(3):
        learner.step(batch)
    assert learner.method.stage_index == 0
    learner.step(batch)
    assert learner.method.stage_index == 1
    learner = resumed(plateau_window=1, plateau_patience=1)
    low, high = batches_by_loss(learner, 2)
    learner.step(high)
    learner.step(low)
    assert learner.method.stage_index == 0
    learner.step(low)
    assert learner.method.stage_index == 1


def test_plateau_tracking_starts_afresh_in_every_stage():
    """Stage 0 ends on a plateau (window 1, patience 1, the same batch twice at lr 0); stage 1's tracker
    starts empty: its losses high, low (an improvement), highest (none) end it on the third step; stage 2's
    too: the same loss twice ends it on the second."""
    learner = segprop_learner(lr=0.0, plateau_window=1, plateau_patience=1)
    method, batch = learner.method, feature_batches(1, seed=5)[0]
    learner.step(batch)
    learner.step(batch)
    assert method.stage_index == 1
    low, high, highest = batches_by_loss(learner, 3)
    learner.step(high)
    learner.step(low)
    assert method.stage_index == 1
    learner.step(highest)
    assert method.stage_index == 2
    # And again in the last stage: one batch at lr 0, the second step is no improvement and ends it.
    learner.step(batch)
    assert not method.finished
    learner.step(batch)
    assert method.finished


def test_resume_mid_window_continues_the_plateau_tracker_exactly(tmp_path):
    """A checkpoint written in the middle of a plateau window, with a best window and one window without
    improvement behind it: the resumed run has the same tracker, losses, stages and weights as the straight run, step by step."""
    options = {"plateau_window": 3, "plateau_patience": 2}
    batches = [feature_batches(4)[i % 4] for i in range(22)]
    straight, first = segprop_learner(lr=0.5, **options), segprop_learner(lr=0.5, **options)
    trace = []
    for batch in batches:
        trace.append((straight.step(batch).loss, straight.method.state_dict()))
    for batch in batches[:7]:
        first.step(batch)
    tracker = first.method.state_dict()["plateau"]
    assert tracker[0] is not None and tracker[1] == 1 and tracker[3] == 1 and int(tracker[2]) != tracker[3]
    first.save(tmp_path / "ckpt.safetensors")
    second = segprop_learner(lr=0.5, **options).load(tmp_path / "ckpt.safetensors")
    assert second.method.state_dict() == first.method.state_dict()
    for step, batch in enumerate(batches[7:], start=7):
        loss = second.step(batch).loss
        assert (loss, second.method.state_dict()) == trace[step], f"step {step + 1}"
    assert trace[-1][1]["stage"] > trace[6][1]["stage"]   # a plateau ended a stage after the resume
    a, b = straight.model.state_dict(), second.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_plateau_tracker_compares_mean_window_losses_across_a_resume_with_another_window():
    """The tracker keeps the best *mean* loss of a window (docs/methods/segprop.md: "the mean loss of a window of steps"):
    resumed with another plateau_window, windows of the new size compare with it as means. One batch at
    lr 0 has the same loss every step, so the first window after the resume is no improvement."""
    batch = feature_batches(1, seed=7)[0]
    before = segprop_learner(lr=0.0, plateau_window=2, plateau_patience=1)
    before.step(batch)
    before.step(batch)
    state = before.method.state_dict()
    assert state["stage"] == 0 and state["plateau"][0] is not None
    after = segprop_learner(lr=0.0, plateau_window=1, plateau_patience=1)
    after.method.load_state_dict(state)
    after.step(batch)
    assert after.method.stage_index == 1


# -- activation checkpointing ----------------------------------------------------------------------------

def test_activation_checkpointing_gives_the_same_updates_in_every_stage():
    """checkpoint=True only recomputes activations: across all three stages (stage 0's input and the
    later stages' detached frozen-prefix outputs need no grad) every weight ends as without it."""
    models = []
    for checkpoint in (False, True):
        learner = segprop_learner(steps_per_stage=2, checkpoint=checkpoint)
        for batch in feature_batches(6):
            learner.step(batch)
        assert learner.method.finished
        models.append(learner.model)
    plain, checkpointed = (dict(m.named_parameters()) for m in models)
    assert set(plain) == set(checkpointed)
    for name in plain:
        assert torch.equal(plain[name], checkpointed[name]), name
    start = mlp_float64()
    assert all(not torch.equal(p, plain[n]) for n, p in start.named_parameters())   # everything trained


def forward_calls(module: nn.Module) -> list[int]:
    """A counter of the module's forward calls (a pre-hook: a recomputation in the backward may stop
    early, before a forward hook would run)."""
    calls = [0]

    def count(*args) -> None:
        calls[0] += 1
    module.register_forward_pre_hook(count)
    return calls


@pytest.mark.parametrize("checkpoint", [False, True])
def test_checkpoint_option_recomputes_each_active_unit_in_the_backward(checkpoint):
    """checkpoint=True: every active unit and head unit runs its forward again in the backward (the
    saved activations are dropped); checkpoint=False: once per step. The adapter and the task head are
    never checkpointed."""
    learner = segprop_learner(checkpoint=checkpoint)
    model = learner.model
    calls = {name: forward_calls(module) for name, module in
             [("blocks.0", model.blocks[0]), ("blocks.3", model.blocks[3]), ("head", model.head)]}
    learner.step(feature_batches(1)[0])
    runs = 2 if checkpoint else 1
    assert {name: c[0] for name, c in calls.items()} == {"blocks.0": runs, "blocks.3": runs, "head": 1}


# -- train() / eval() -------------------------------------------------------------------------------------

def test_the_stage_trains_in_train_mode_even_if_the_model_was_in_eval():
    """The method's own protocol (step(batch, optimizer), no Learner) on a model handed over in eval()
    (as after evaluating it): the stage's modules are put in train(), so the active units' BatchNorm
    normalises with batch statistics and updates its running statistics."""
    from edgetrain.models.resnet import ResNetConfig, build_resnet

    model = build_resnet(ResNetConfig(num_classes=3, in_channels=1, stem="cifar", norm="batch", width=4,
                                      blocks_per_stage=(1, 1, 1), seed=0))
    model.eval()
    method = edgetrain.methods.METHODS.get("segprop")(model, head_blocks=1, segments=2,
                                                     example_input=torch.zeros(2, 1, 8, 8))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(0)
    batch = Batch(torch.randn(6, 1, 8, 8, generator=generator), torch.randint(0, 3, (6,), generator=generator), 0)
    active = [method.view.embed, *method.view.units[method.stage.start:method.stage.end]]
    running = {n: b.clone() for m in active for n, b in m.named_buffers() if n.endswith("running_mean")}
    assert running
    method.step(batch, optimizer)
    trained = [*active, *method.view.units[method.stage.tail_start:], method.view.head, method.bridge(method.stage)]
    assert all(m.training for module in trained for m in module.modules())
    after = {n: b for m in active for n, b in m.named_buffers() if n.endswith("running_mean")}
    assert all(not torch.equal(running[n], after[n]) for n in running)
    method.finish()


# -- SnapCheck --------------------------------------------------------------------------------------------

def test_snapcheck_builds_a_new_stage_prefix_from_the_previous_stage_entries():
    """docs/methods/segprop.md: "At a stage change, the new, deeper prefix is built from the cached shallower entry by
    running only the newly committed units": in stage 2 (prefix blocks.0, blocks.1) the batches cached at
    depth 1 in stage 1 run blocks.1 only, never blocks.0; the weights equal those without SnapCheck."""
    batches = feature_batches(2)
    results = []
    for snapcheck in (False, True):
        learner = segprop_learner(steps_per_stage=2, snapcheck=snapcheck)
        calls = forward_calls(learner.model.blocks[0]), forward_calls(learner.model.blocks[1])
        for stage in range(3):
            before = calls[0][0], calls[1][0]
            for batch in batches:
                learner.step(batch)
            ran = calls[0][0] - before[0], calls[1][0] - before[1]
        results.append((ran, dict(learner.model.named_parameters())))
        assert learner.method.finished
        learner.method.finish()
    (plain_ran, plain), (cached_ran, cached) = results
    assert plain_ran == (2, 2)          # without SnapCheck, the prefix runs for every batch
    assert cached_ran == (0, 2)         # with it, only the newly committed unit
    assert all(torch.equal(plain[n], cached[n]) for n in plain)


def test_loading_an_earlier_stage_reopens_its_segment(tmp_path):
    """A learner that got to stage 2 loads a checkpoint of stage 1: blocks.1 trains again (no longer
    pinned in eval()), only the embedding and blocks.0 stay committed, and the next step is the one a
    fresh learner loading the same checkpoint takes."""
    from edgetrain.methods.segprop import is_pinned

    batches = feature_batches(5)
    learner = segprop_learner(steps_per_stage=2)
    for batch in batches[:2]:
        learner.step(batch)
    learner.save(tmp_path / "stage1.safetensors")
    for batch in batches[2:4]:
        learner.step(batch)
    model = learner.model
    assert learner.method.stage_index == 2 and is_pinned(model.blocks[1])
    learner.load(tmp_path / "stage1.safetensors")
    learner.step(batches[4])
    assert learner.method.stage_index == 1
    assert is_pinned(model.embed) and is_pinned(model.blocks[0])
    assert not is_pinned(model.blocks[1]) and all(m.training for m in model.blocks[1].modules())
    model.eval()
    model.train()   # what Learner.evaluate does afterwards: the reopened segment follows it
    assert all(m.training for m in model.blocks[1].modules()) and not model.blocks[0].training
    fresh = segprop_learner(steps_per_stage=2).load(tmp_path / "stage1.safetensors")
    fresh.step(batches[4])
    a, b = dict(model.named_parameters()), dict(fresh.model.named_parameters())
    assert all(torch.equal(a[n], b[n]) for n in a)
