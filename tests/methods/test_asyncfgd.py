"""`asyncfgd`: the K-module pipeline against its reference scheduler and against Eq. 6-8 written out
directly; K=1 against `fgd`; resuming mid-pipeline; zoo models; digits accuracy next to fgd and bp."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call, jvp

import edgetrain
import edgetrain.methods.asyncfgd  # noqa: F401  (registers asyncfgd until edgetrain.methods imports it)
import edgetrain.methods.fgd  # noqa: F401
from edgetrain.data import digits_stream, load_digits_split
from edgetrain.data.batch import Batch
from edgetrain.methods.asyncfgd import AsyncFGD, split_units
from edgetrain.methods.base import NonFiniteError
from edgetrain.methods.fgd import ForwardGradient, block_units
from edgetrain.methods.tangents import TangentKey, draw_tangent
from edgetrain.models import load_model
from edgetrain.models.mlp import MLPConfig, build_mlp
from edgetrain.models.zoo import example_input
from edgetrain.registry import EdgetrainError

REPO = Path(__file__).resolve().parents[2]


# One intra-op thread (tests/conftest.py: fixed reduction order, no OpenMP spinning).
pytestmark = pytest.mark.usefixtures("one_thread")


def train_digits(method: str, epochs: int, lr: float, method_options: dict | None = None) -> float:
    """Test accuracy of the 64-32-10 Tanh MLP trained on the digits train split, batch 32, SGD
    (the same recipe as test_fgd's short run)."""
    learner = edgetrain.Learner(load_model("mlp-digits"), method=method, lr=lr, probe=False,
                                method_options=method_options or {})
    try:
        for batch in digits_stream("train", batch_size=32, epochs=epochs, seed=0):
            learner.step(batch)
        inputs, labels = load_digits_split("test")
        return learner.evaluate([Batch(inputs, labels)])["accuracy"]
    finally:
        if hasattr(learner.method, "close"):
            learner.method.close()


def deep_mlp(batch_norm: bool = True) -> torch.nn.Module:
    return build_mlp(MLPConfig(input_shape=(8,), hidden_sizes=(6, 5, 7, 6), num_classes=3, activation="tanh",
                               batch_norm=batch_norm))


def batches(count: int, batch_size: int = 8, seed: int = 0) -> list[Batch]:
    generator = torch.Generator().manual_seed(seed)
    return [Batch(torch.randn(batch_size, 8, generator=generator),
                  torch.randint(0, 3, (batch_size,), generator=generator), i) for i in range(count)]


def train(method: type, stream: list[Batch], lr: float = 0.05, **options) -> tuple[torch.nn.Module, list[float], object]:
    model = deep_mlp(batch_norm=options.pop("batch_norm", True))
    trainer = method(model, **options)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses = [float(trainer.step(b, optimizer)) for b in stream]
    return model, losses, trainer


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_split_follows_the_block_view_and_the_papers_tables():
    def names(model, k):
        return [[u.name for u in group] for group in split_units(block_units(model), k)]

    digits = load_model("mlp-digits")
    assert names(digits, 2) == [["embed", "blocks.0"], ["head"]]
    assert names(digits, 3) == [["embed"], ["blocks.0"], ["head"]]
    fcs = load_model("fcs")  # Table 5: fc1 | fc2 | fc3 (+ the output layer)
    assert names(fcs, 3) == [["embed", "blocks.0"], ["blocks.1"], ["blocks.2", "head"]]
    resnet = load_model("resnet18-cifar")  # §H.3.2: one residual stage (2 blocks) per worker
    assert [len(g) for g in names(resnet, 4)] == [3, 2, 2, 3]
    assert names(fcs, 2) == [["embed", "blocks.0", "blocks.1"], ["blocks.2", "head"]]
    assert [[u.name for u in g] for g in split_units(block_units(fcs), 2, [1, 2])][1] == ["blocks.1", "blocks.2", "head"]
    with pytest.raises(EdgetrainError, match="need at least"):
        split_units(block_units(digits), 4)
    with pytest.raises(EdgetrainError, match="summing to"):
        split_units(block_units(fcs), 2, [1, 1])


@pytest.mark.parametrize("num_modules", [2, 3])
def test_parallel_workers_give_the_reference_schedulers_weights(num_modules):
    stream = batches(14)
    for options in ({}, {"num_tangents": 2, "tangent_checkpoint": False, "alpha": {"blocks.1": 0.0}}):
        reference, ref_losses, _ = train(AsyncFGD, stream, num_modules=num_modules, runtime="reference", **options)
        threaded, losses, trainer = train(AsyncFGD, stream, num_modules=num_modules, runtime="threads", **options)
        trainer.close()
        assert same_weights(reference, threaded)
        assert losses == ref_losses


def test_one_module_is_exactly_fgd():
    stream = batches(10)
    for options in ({}, {"num_tangents": 3, "alpha": {"head": 0.5}}):
        fgd, fgd_losses, _ = train(ForwardGradient, stream, **options)
        single, losses, _ = train(AsyncFGD, stream, num_modules=1, **options)
        assert same_weights(fgd, single) and losses == fgd_losses


def eq_6_to_8_written_out(stream: list[Batch], num_modules: int, lr: float, seed: int) -> dict[str, torch.Tensor]:
    """AsyncFGD computed straight from the paper, independently of the pipeline code: keep every
    weight version w^v; the update at timestamp t (Eq. 8) uses the sample that entered at
    t' = t-K+1, whose forward went through module k with w_G(k)^{t-2K+k+2} (Eq. 6, clamped at w^0
    by Eq. 9) along the tangent keyed (t', k); JVPs by torch.func.jvp over the whole function."""
    model = deep_mlp(batch_norm=False)
    groups = split_units(block_units(model), num_modules)
    module_of = {c: k for k, group in enumerate(groups) for unit in group for _, c in unit.parameters}
    index = {name: i for i, (name, _) in enumerate(model.named_parameters())}
    versions = [{n: p.detach().clone() for n, p in model.named_parameters()}]
    K = num_modules
    for t in range(K - 1, len(stream)):
        sample = t - K + 1
        used = {n: versions[max(0, t - 2 * K + module_of[n] + 2)][n] for n in index}
        tangents = {n: draw_tangent(w, TangentKey(seed, sample, module_of[n], 0).parameter_seed(index[n]))
                    for n, w in used.items()}
        batch = stream[sample]
        _, derivative = jvp(lambda p: F.cross_entropy(functional_call(model, p, (batch.inputs,)), batch.targets),
                            (used,), (tangents,))
        versions.append({n: versions[-1][n] - lr * derivative * tangents[n] for n in index})
    return versions[-1]


@pytest.mark.parametrize("num_modules", [2, 3])
def test_staleness_indices_are_those_of_eq_6_to_8(num_modules):
    stream = batches(12)
    model, _, trainer = train(AsyncFGD, stream, lr=0.1, num_modules=num_modules, runtime="reference", seed=7,
                              batch_norm=False)
    assert trainer.staleness == list(range(num_modules - 1, -1, -1))
    expected = eq_6_to_8_written_out(stream, num_modules, lr=0.1, seed=7)
    for name, param in model.named_parameters():
        assert torch.allclose(param, expected[name], atol=1e-6), name
    # Sanity: without staleness (plain FGD on the same samples) the weights differ.
    fgd_model, _, _ = train(ForwardGradient, stream[:len(stream) - num_modules + 1], lr=0.1, seed=7, batch_norm=False)
    assert not same_weights(model, fgd_model)


@pytest.mark.parametrize("checkpoint,alpha", [(True, 1.0), (False, 1.0), (False, {"head": 0.0})],
                         ids=["checkpointed", "kept", "kept-frozen-head"])
def test_learner_resumes_mid_pipeline_exactly(tmp_path, checkpoint, alpha):
    # Without checkpointing the kept tangents of the samples in flight are state: a resumed pipeline must
    # keep them again (drawn from their seeds) for exactly the perturbed parameters.
    options = {"num_modules": 3, "runtime": "threads", "num_tangents": 2, "tangent_checkpoint": checkpoint,
               "seed": 11, "alpha": alpha}

    def learner():
        return edgetrain.Learner(deep_mlp(), method="asyncfgd", lr=0.05, probe=False, method_options=options)

    stream = batches(12)
    straight = learner()
    straight_losses = [straight.step(b).loss for b in stream]
    first = learner()
    for b in stream[:5]:
        first.step(b)
    first.save(tmp_path / "ckpt.safetensors")
    resumed = learner().load(tmp_path / "ckpt.safetensors")
    assert resumed.method.steps_taken == 5 and all(item is not None for item in resumed.method.in_flight)
    assert (resumed.method.bank.kept_bytes() > 0) == (not checkpoint)
    resumed_losses = [resumed.step(b).loss for b in stream[5:]]
    assert same_weights(straight.model, resumed.model)
    assert resumed_losses == straight_losses[5:]
    for each in (straight, first, resumed):
        each.method.close()


def test_kept_tangents_grow_with_depth_and_checkpointed_ones_do_not_exist():
    stream = batches(6)
    for K in (1, 2, 3):
        _, _, kept = train(AsyncFGD, stream, num_modules=K, runtime="reference", tangent_checkpoint=False)
        _, _, checkpointed = train(AsyncFGD, stream, num_modules=K, runtime="reference")
        # Between steps module k holds the tangents of the K-1-k samples it has run but not yet
        # updated with (the update of timestamp t used up sample t-K+1's).
        expected = sum((K - 1 - stage.index) * sum(p.numel() * 4 for p in stage.params.values())
                       for stage in kept.stages)
        assert kept.bank.kept_bytes() == expected
        assert checkpointed.bank.kept_bytes() == 0
        assert (expected > 0) == (K > 1)


def test_fill_steps_report_the_entering_batchs_loss_and_a_non_finite_sample_updates_nothing():
    model = deep_mlp(batch_norm=False)
    trainer = AsyncFGD(model, num_modules=3, runtime="threads")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    stream = batches(4)
    expected = F.cross_entropy(model(stream[0].inputs), stream[0].targets)
    assert torch.allclose(trainer.step(stream[0], optimizer), expected)
    trainer.step(stream[1], optimizer)
    assert torch.allclose(trainer.step(stream[2], optimizer), expected)  # sample 0 leaves, weights w^0
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    bad = Batch(stream[3].inputs.clone(), stream[3].targets)
    bad.inputs[0, 0] = float("nan")
    trainer.step(bad, optimizer)  # the NaN enters module 0 at t=3; it leaves at t=5
    trainer.step(stream[0], optimizer)
    after_good_step = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(NonFiniteError, match="entered at step 3"):
        trainer.step(stream[1], optimizer)
    assert all(torch.equal(p, after_good_step[n]) for n, p in model.named_parameters())
    assert any(not torch.equal(after_good_step[n], before[n]) for n in before)
    assert trainer.steps_taken == 6 and trainer.in_flight[1].sample == 4  # the bad sample is gone
    losses = [float(trainer.step(b, optimizer)) for b in stream]  # the pipeline flows on
    assert all(loss == loss for loss in losses)
    trainer.close()


def test_gradients_is_the_unstale_estimate_and_changes_nothing():
    model = deep_mlp()
    trainer = AsyncFGD(model, num_modules=2, runtime="threads")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for b in batches(3):
        trainer.step(b, optimizer)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    in_flight, steps = trainer.in_flight[0], trainer.steps_taken
    batch = batches(1, seed=5)[0]
    loss, grads = trainer.gradients(batch)
    assert set(grads) == set(weights) and all(g.shape == weights[n].shape for n, g in grads.items())
    assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters())
    assert trainer.in_flight[0] is in_flight and trainer.steps_taken == steps
    trainer.close()
    # With K=1 it is fgd's estimate.
    one = AsyncFGD(deep_mlp(), num_modules=1)
    _, fgd_grads = ForwardGradient(deep_mlp()).gradients(batch)
    _, one_grads = one.gradients(batch)
    assert all(torch.equal(fgd_grads[n], one_grads[n]) for n in fgd_grads)


@pytest.mark.parametrize("name,num_modules", [("fcs-relu", 3), ("convs", 3), ("convl", 3), ("resnet18-cifar", 4),
                                              ("mobilenetv3-small-cifar", 4)])
def test_zoo_models_train_through_the_learner(name, num_modules):
    model = load_model(name)
    learner = edgetrain.Learner(model, method="asyncfgd", lr=1e-4, probe=False,
                                method_options={"num_modules": num_modules, "runtime": "threads"})
    generator = torch.Generator().manual_seed(0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    stream = [Batch(example_input(model, 2, 0, generator=generator), torch.randint(0, 10, (2,), generator=generator), i)
              for i in range(num_modules)]
    losses = [learner.step(b).loss for b in stream]
    learner.method.close()
    assert all(loss == loss and loss > 0 for loss in losses)
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert len(changed) == len(before)  # one update so far, and it reached every module


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the cuda-streams runtime needs a CUDA device")
def test_cuda_streams_give_the_reference_schedulers_weights():
    stream = [Batch(b.inputs.cuda(), b.targets.cuda(), b.index) for b in batches(10)]
    results = []
    for runtime in ("reference", "cuda-streams"):
        model = deep_mlp().cuda()
        trainer = AsyncFGD(model, num_modules=3, runtime=runtime)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        losses = [float(trainer.step(b, optimizer)) for b in stream]
        torch.cuda.synchronize()
        trainer.close()
        results.append((model, losses))
    assert same_weights(results[0][0], results[1][0]) and results[0][1] == results[1][1]


def test_asyncfgd_stays_close_to_fgd_on_digits_in_a_short_run():
    fgd = train_digits("fgd", epochs=60, lr=0.007)
    pipelined = train_digits("asyncfgd", epochs=60, lr=0.007, method_options={"num_modules": 2})
    assert pipelined >= 0.85 and abs(pipelined - fgd) <= 0.05


@pytest.mark.slow
def test_digits_table_fgd_asyncfgd_and_bp():
    """Paper Table 1 layout on scikit-learn digits (64-32-10 Tanh MLP, SGD, batch 32, 200 epochs)."""
    accuracy = {"bp": train_digits("bp", epochs=200, lr=0.5),
                "fgd": train_digits("fgd", epochs=200, lr=0.005)}
    for K in (2, 3):
        accuracy[f"asyncfgd K={K}"] = train_digits("asyncfgd", epochs=200, lr=0.005,
                                                   method_options={"num_modules": K})
    print("\n" + " | ".join(f"{name} {value:.3f}" for name, value in accuracy.items()))
    assert accuracy["fgd"] >= 0.92
    for K in (2, 3):
        assert abs(accuracy[f"asyncfgd K={K}"] - accuracy["fgd"]) <= 0.03


def test_transfer_sample_runs_quick():
    result = subprocess.run([sys.executable, str(REPO / "samples" / "orin_asyncfgd_transfer.py"), "--quick",
                             "--device", "cpu"], capture_output=True, text=True, timeout=240, cwd=REPO)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "adapted with asyncfgd: accuracy" in result.stdout
    assert "of bp)" in result.stdout


def test_changing_alpha_mid_flight_without_tangent_checkpointing_is_refused():
    # Kept tangents were drawn with the old scales: updating with them would not be the documented
    # "in-flight samples update with the new scales", and a parameter unfrozen mid-flight would have
    # no kept tangent at all. With tangent checkpointing the change is allowed.
    for checkpointing in (False, True):
        model = deep_mlp(batch_norm=False)
        method = AsyncFGD(model, num_modules=2, runtime="reference", alpha={"blocks.0": 0.0},
                          tangent_checkpoint=checkpointing)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        method.set_alpha({"blocks.0": 0.0})  # nothing in flight yet: allowed either way
        for batch in batches(3):
            method.step(batch, optimizer)
        if checkpointing:
            method.set_alpha(1.0)
            method.step(batches(4)[3], optimizer)
            assert method.alpha_spec == 1.0
        else:
            with pytest.raises(EdgetrainError, match="set_alpha with samples in flight needs tangent_checkpoint=True"):
                method.set_alpha(1.0)
            assert method.alpha_spec == {"blocks.0": 0.0}
