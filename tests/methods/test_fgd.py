"""`fgd`: forward gradients along seeded tangents -- unbiasedness, seed regeneration, alpha scaling,
several tangents per step, optimizers, resuming, and training on real data (scikit-learn digits)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import edgetrain
import edgetrain.methods.fgd  # noqa: F401  (registers fgd until edgetrain.methods imports it)
from edgetrain.data import digits_stream, load_digits_split
from edgetrain.data.batch import Batch
from edgetrain.methods.base import NonFiniteError
from edgetrain.methods.fgd import ForwardGradient
from edgetrain.methods.tangents import TangentKey, draw_tangent, mix_seed, resolve_alpha
from edgetrain.models.mlp import MLPConfig, build_mlp, digits_mlp_config
from edgetrain.registry import EdgetrainError


# One intra-op thread (tests/conftest.py: fixed reduction order, no OpenMP spinning).
pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_mlp(batch_norm: bool = True) -> torch.nn.Module:
    return build_mlp(MLPConfig(input_shape=(8,), hidden_sizes=(6, 5), num_classes=3, activation="tanh",
                               batch_norm=batch_norm))


def tiny_batches(count: int, batch_size: int = 16, seed: int = 0) -> list[Batch]:
    generator = torch.Generator().manual_seed(seed)
    return [Batch(torch.randn(batch_size, 8, generator=generator), torch.randint(0, 3, (batch_size,), generator=generator), i)
            for i in range(count)]


def flat(grads: dict[str, torch.Tensor], names) -> torch.Tensor:
    return torch.cat([grads[name].flatten() for name in names])


def autograd_gradient(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    buffers = [b.clone() for b in model.buffers()]
    model.zero_grad()
    F.cross_entropy(model(batch.inputs), batch.targets).backward()
    grad = torch.cat([p.grad.flatten() for p in model.parameters()])
    model.zero_grad()
    with torch.no_grad():
        for buffer, kept in zip(model.buffers(), buffers):
            buffer.copy_(kept)
    return grad


def test_mean_of_forward_gradients_converges_to_the_autograd_gradient():
    model = tiny_mlp(batch_norm=True)
    batch = tiny_batches(1)[0]
    truth = autograd_gradient(model, batch)
    method = ForwardGradient(model, seed=123)
    names = [n for n, _ in model.named_parameters()]
    total = torch.zeros_like(truth)
    cosines = []
    for sample in range(2000):
        method.steps_taken = sample  # a fresh tangent per estimate, weights unchanged
        loss, grads = method.gradients(batch)
        total += flat(grads, names)
        if sample + 1 in (20, 2000):
            cosines.append(float(F.cosine_similarity(total, truth, dim=0)))
    # Each estimate has ~d times the gradient's squared norm as variance (d = 117 here), so the
    # mean of 2000 lands within a few degrees; a handful of estimates is still far off.
    assert cosines[-1] >= 0.95
    assert cosines[0] < cosines[-1]
    assert torch.allclose(loss, F.cross_entropy(model(batch.inputs), batch.targets))


def test_regenerated_tangents_are_bit_identical_to_the_ones_the_forward_used():
    model = tiny_mlp()
    kept = ForwardGradient(model, seed=5, num_tangents=2, tangent_checkpoint=False)
    batch = tiny_batches(1)[0]
    kept.stage.forward(7, batch.inputs, [None, None])
    stored = dict(((key, name), t.clone()) for (key, name), t in kept.bank._kept.items())
    assert len(stored) == 2 * len(kept.params)
    for (key, name), tangent in stored.items():
        assert key.sample == 7 and key.module == 0
        regenerated = kept.bank.draw(key, name, kept.params[name])
        assert torch.equal(regenerated, tangent)
    # And the weights after training agree bit for bit with and without tangent checkpointing.
    trained = []
    for checkpoint in (True, False):
        model = tiny_mlp()
        method = ForwardGradient(model, seed=5, num_tangents=2, tangent_checkpoint=checkpoint)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        for b in tiny_batches(6):
            method.step(b, optimizer)
        trained.append(model.state_dict())
        assert method.bank.kept_bytes() == 0  # every kept tangent was used by its update
    assert all(torch.equal(trained[0][k], trained[1][k]) for k in trained[0])


def test_tangent_keys_give_independent_draws_and_alpha_prefixes_follow_module_names():
    like = torch.empty(1000)
    a = draw_tangent(like, TangentKey(0, 3, 1, 0).parameter_seed(2))
    assert torch.equal(a, draw_tangent(like, TangentKey(0, 3, 1, 0).parameter_seed(2)))
    for other in (TangentKey(0, 4, 1, 0), TangentKey(0, 3, 0, 0), TangentKey(0, 3, 1, 1), TangentKey(1, 3, 1, 0)):
        assert abs(float(F.cosine_similarity(a, draw_tangent(like, other.parameter_seed(2)), dim=0))) < 0.15
    assert mix_seed(1, 2) != mix_seed(2, 1) and 0 <= mix_seed(2**70, -1) < 2**63
    alphas = resolve_alpha({"": 0.5, "blocks.1": 0.0, "blocks.1.linear.bias": 1.0},
                           ["blocks.1.linear.weight", "blocks.1.linear.bias", "blocks.10.linear.weight", "head.weight"])
    assert alphas == {"blocks.1.linear.weight": 0.0, "blocks.1.linear.bias": 1.0,
                      "blocks.10.linear.weight": 0.5, "head.weight": 0.5}
    with pytest.raises(EdgetrainError, match="matches no trainable parameter"):
        resolve_alpha({"blocks.9": 0.0}, ["head.weight"])
    with pytest.raises(EdgetrainError, match="in \\[0, 1\\]"):
        resolve_alpha(1.5, ["head.weight"])


def test_alpha_scales_the_estimate_by_alpha_squared_and_zero_freezes_a_group_but_passes_jvps_on():
    batch = tiny_batches(1)[0]
    model = tiny_mlp(batch_norm=False)
    _, full = ForwardGradient(model, seed=1).gradients(batch)
    _, scaled = ForwardGradient(model, seed=1, alpha=0.3).gradients(batch)
    for name in full:  # u' = 0.3 u everywhere, so dL/du' = 0.3 dL/du and the estimate is 0.09 x
        assert torch.allclose(scaled[name], 0.09 * full[name], rtol=1e-4, atol=1e-7)

    # Freeze the first hidden layer: it is not perturbed and not updated, yet the later layers,
    # whose JVPs start after it, and with the head frozen the earlier ones, still learn.
    for frozen in ("blocks.0", "head"):
        model = tiny_mlp(batch_norm=False)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        method = ForwardGradient(model, seed=2, alpha={frozen: 0.0})
        _, grads = method.gradients(batch)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for b in tiny_batches(3):
            method.step(b, optimizer)
        for name, param in model.named_parameters():
            if name.startswith(frozen + "."):
                assert torch.equal(param, before[name]) and not grads[name].any()
            else:
                assert not torch.equal(param, before[name]) and grads[name].any()
    with pytest.raises(EdgetrainError, match="alpha is 0 for every"):
        ForwardGradient(tiny_mlp(), alpha=0.0)


def test_several_tangents_per_step_lower_the_variance_and_batchnorm_updates_once():
    model = tiny_mlp(batch_norm=True)
    batch = tiny_batches(1)[0]
    truth = autograd_gradient(model, batch)
    names = [n for n, _ in model.named_parameters()]
    mean_cosine = {}
    for count in (1, 16):
        method = ForwardGradient(model, seed=9, num_tangents=count)
        cosines = []
        for sample in range(40):
            method.steps_taken = sample
            cosines.append(float(F.cosine_similarity(flat(method.gradients(batch)[1], names), truth, dim=0)))
        mean_cosine[count] = sum(cosines) / len(cosines)
    # The cosine of one estimate grows about like sqrt(tangents / d) while it is small.
    assert mean_cosine[16] > 2.5 * mean_cosine[1] > 0

    stats = []
    for count in (1, 4):
        model = tiny_mlp(batch_norm=True)
        ForwardGradient(model, num_tangents=count).step(batch, torch.optim.SGD(model.parameters(), lr=0.1))
        stats.append([b.clone() for b in model.buffers()])
    assert all(torch.equal(a, b) for a, b in zip(*stats))  # running stats move once per step


def test_a_general_optimizer_gets_the_estimate_in_grad_and_matches_the_in_place_sgd_update():
    class NotPlainSGD(torch.optim.SGD):  # same arithmetic, but not recognised as plain SGD
        pass

    results = []
    for optimizer_class in (torch.optim.SGD, NotPlainSGD):
        model = tiny_mlp()
        method = ForwardGradient(model, seed=4, num_tangents=2)
        optimizer = optimizer_class(model.parameters(), lr=0.05)
        for b in tiny_batches(5):
            method.step(b, optimizer)
        results.append(model.state_dict())
        assert all(p.grad is None for p in model.parameters())
    for key in results[0]:
        assert torch.allclose(results[0][key], results[1][key], atol=1e-6)

    model = tiny_mlp()  # Adam runs (and is documented to stall on forward gradients)
    learner = edgetrain.Learner(model, method="fgd", optimizer="adam", lr=1e-3, probe=False)
    assert all(learner.step(b).loss > 0 for b in tiny_batches(3))


def test_learner_resumes_fgd_exactly(tmp_path):
    def learner():
        return edgetrain.Learner(tiny_mlp(), method="fgd", lr=0.05, probe=False,
                                 method_options={"seed": 3, "num_tangents": 2, "alpha": {"blocks.0": 0.5}})

    batches = tiny_batches(10)
    straight = learner()
    for b in batches:
        straight.step(b)
    first = learner()
    for b in batches[:4]:
        first.step(b)
    first.save(tmp_path / "ckpt.safetensors")
    resumed = learner().load(tmp_path / "ckpt.safetensors")
    assert resumed.method.steps_taken == 4
    for b in batches[4:]:
        resumed.step(b)
    assert all(torch.equal(a, b) for a, b in zip(straight.model.state_dict().values(),
                                                 resumed.model.state_dict().values()))


def test_non_finite_loss_stops_the_step_before_any_weight_changes():
    model = tiny_mlp(batch_norm=False)
    method = ForwardGradient(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    bad = tiny_batches(1)[0]
    bad.inputs[0, 0] = float("nan")  # the learner's batch validation would refuse it; call the method
    with pytest.raises(NonFiniteError):
        method.step(bad, torch.optim.SGD(model.parameters(), lr=0.1))
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert method.steps_taken == 0


def train_digits(method: str, epochs: int, lr: float, method_options: dict | None = None) -> float:
    """Test accuracy of the 64-32-10 Tanh MLP trained on the digits train split, batch 32, SGD."""
    model = build_mlp(digits_mlp_config())
    learner = edgetrain.Learner(model, method=method, lr=lr, probe=False, method_options=method_options or {})
    try:
        for batch in digits_stream("train", batch_size=32, epochs=epochs, seed=0):
            learner.step(batch)
        inputs, labels = load_digits_split("test")
        return learner.evaluate([Batch(inputs, labels)])["accuracy"]
    finally:
        close = getattr(learner.method, "close", None)
        if close is not None:
            close()


def test_fgd_learns_digits_in_a_short_run():
    # 60 epochs (~2,600 steps, a few seconds); the full 200-epoch table is the slow test in test_asyncfgd.
    assert train_digits("fgd", epochs=60, lr=0.007) >= 0.85


def test_on_a_lora_decoder_the_jvp_is_the_autograd_directional_derivative():
    # Attention's fused CPU kernel has no forward-mode rule; the decoder must fall back to the math
    # kernel under dual tensors, and the JVP must then equal grad . u from reverse mode.
    from edgetrain.data import text_stream
    from edgetrain.methods import METHODS

    torch.manual_seed(0)
    model = edgetrain.load_model("tiny")
    edgetrain.add_lora(model, rank=4)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.02)  # so that lora_A gets a gradient too
    batch = next(iter(text_stream(seq_len=16, batch_size=2, vocab_size=model.config.vocab_size)))
    bp_loss, truth = METHODS.get("bp")(model).gradients(batch)
    method = ForwardGradient(model, seed=3, tangent_checkpoint=False)
    loss, derivatives = method.loss_and_derivatives(batch, 0)
    tangents = {name: t.clone() for (key, name), t in method.bank._kept.items()}
    assert set(tangents) == set(truth)
    directional = sum(float((truth[name] * u).sum()) for name, u in tangents.items())
    assert loss == pytest.approx(float(bp_loss), rel=1e-6)
    assert derivatives[0] == pytest.approx(directional, rel=1e-4)
    estimate = method.stage.estimate(0, derivatives)
    for name, u in tangents.items():
        torch.testing.assert_close(estimate[name], derivatives[0] * u)
