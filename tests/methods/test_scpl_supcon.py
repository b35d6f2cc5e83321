"""SCPL's supervised contrastive loss against Eq. (2) written out term by term, in plain Python loops,
in float64: one view and two, a class with a single sample, no positives at all, and the gradient."""
from __future__ import annotations

import math

import pytest
import torch

from edgetrain.methods.scpl import supcon_loss
from edgetrain.registry import EdgetrainError


def eq2_reference(z: torch.Tensor, groups: list[int], tau: float) -> tuple[float, list[float | None]]:
    """Eq. (2): sum over anchors i of -1/|P(i)| sum_{p in P(i)} log(exp(z_i.z_p/tau) / sum_{j != i} exp(z_i.z_j/tau)),
    P(i) = the other rows with i's label; rows already L2-normalised. Anchors without positives have no
    term (None)."""
    rows = len(groups)
    terms: list[float | None] = []
    for i in range(rows):
        positives = [p for p in range(rows) if p != i and groups[p] == groups[i]]
        if not positives:
            terms.append(None)
            continue
        denominator = sum(math.exp(float(z[i] @ z[j]) / tau) for j in range(rows) if j != i)
        total = 0.0
        for p in positives:
            total += math.log(math.exp(float(z[i] @ z[p]) / tau) / denominator)
        terms.append(-total / len(positives))
    return sum(t for t in terms if t is not None), terms


def normalised(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True)


@pytest.mark.parametrize("tau", [0.1, 0.5])
def test_one_view_matches_eq2(tau):
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(12, 5, generator=generator, dtype=torch.float64)
    labels = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1, 3, 3, 1, 0])
    expected_sum, terms = eq2_reference(normalised(features), labels.tolist(), tau)
    assert all(t is not None for t in terms)
    got_sum = supcon_loss(features, labels, temperature=tau, reduction="sum")
    got_mean = supcon_loss(features, labels, temperature=tau)
    got_terms = supcon_loss(features, labels, temperature=tau, reduction="none")
    assert float(got_sum) == pytest.approx(expected_sum, rel=1e-5)
    assert float(got_mean) == pytest.approx(expected_sum / 12, rel=1e-5)
    assert got_terms.tolist() == pytest.approx(terms, rel=1e-5)


def test_anchor_is_neither_positive_nor_in_the_denominator():
    """The reference code's quirk (the anchor counted in |P(i)|) would change this value: two samples of
    one class and one of another, where every quantity can be written down by hand."""
    z = torch.tensor([[1.0, 0.0], [0.6, 0.8], [0.0, 1.0]], dtype=torch.float64)
    labels = torch.tensor([0, 0, 1])
    tau = 0.1
    # Anchor 0: P = {1}; denominator over rows 1 and 2.
    a0 = -math.log(math.exp(0.6 / tau) / (math.exp(0.6 / tau) + math.exp(0.0 / tau)))
    # Anchor 1: P = {0}; denominator over rows 0 and 2.
    a1 = -math.log(math.exp(0.6 / tau) / (math.exp(0.6 / tau) + math.exp(0.8 / tau)))
    # Anchor 2: no positive, no term.
    assert float(supcon_loss(z, labels, temperature=tau, reduction="sum")) == pytest.approx(a0 + a1, rel=1e-9)
    assert float(supcon_loss(z, labels, temperature=tau)) == pytest.approx((a0 + a1) / 2, rel=1e-9)
    assert supcon_loss(z, labels, temperature=tau, reduction="none")[2] == 0


def test_two_views_match_eq2_with_a_single_sample_class():
    """[N, 2, D] features: the rows are both views of every sample; a class with one sample still has a
    positive (its other view), and every same-label row of either view is one too."""
    generator = torch.Generator().manual_seed(1)
    n = 7
    features = torch.randn(n, 2, 6, generator=generator, dtype=torch.float64)
    labels = torch.tensor([0, 1, 0, 2, 1, 0, 1])  # class 2 has a single sample
    rows = torch.cat([features[:, 0], features[:, 1]])  # view-major, as supcon_loss orders them
    expected, terms = eq2_reference(normalised(rows), labels.repeat(2).tolist(), 0.1)
    assert all(t is not None for t in terms)
    assert float(supcon_loss(features, labels, reduction="sum")) == pytest.approx(expected, rel=1e-6)
    # Two views concatenated along the batch with the labels repeated are the same loss.
    assert float(supcon_loss(rows, labels.repeat(2), reduction="sum")) == pytest.approx(expected, rel=1e-6)
    assert float(supcon_loss(features, labels)) == pytest.approx(expected / (2 * n), rel=1e-6)


def test_single_sample_class_in_one_view_has_no_term():
    generator = torch.Generator().manual_seed(2)
    features = torch.randn(6, 4, generator=generator, dtype=torch.float64)
    labels = torch.tensor([0, 0, 1, 1, 1, 2])  # anchor 5 has no positive
    expected, terms = eq2_reference(normalised(features), labels.tolist(), 0.1)
    assert terms[5] is None
    assert float(supcon_loss(features, labels, reduction="sum")) == pytest.approx(expected, rel=1e-6)
    assert float(supcon_loss(features, labels)) == pytest.approx(expected / 5, rel=1e-6)
    # ... but it is in every other anchor's denominator: dropping it changes their terms.
    without = float(supcon_loss(features[:5], labels[:5], reduction="sum"))
    assert without == pytest.approx(eq2_reference(normalised(features[:5]), labels[:5].tolist(), 0.1)[0], rel=1e-6)
    assert abs(without - expected) > 1e-3


def test_gradient_matches_the_reference_gradient():
    generator = torch.Generator().manual_seed(3)
    base = torch.randn(5, 2, 3, generator=generator, dtype=torch.float64)
    labels = torch.tensor([0, 1, 0, 2, 1])

    def reference(x: torch.Tensor) -> torch.Tensor:  # Eq. (2) with autograd-friendly loops
        z = normalised(torch.cat([x[:, 0], x[:, 1]]))
        groups = labels.repeat(2).tolist()
        total = x.new_zeros(())
        for i in range(len(groups)):
            positives = [p for p in range(len(groups)) if p != i and groups[p] == groups[i]]
            log_denominator = torch.log(sum(torch.exp(z[i] @ z[j] / 0.1) for j in range(len(groups)) if j != i))
            total = total - sum(z[i] @ z[p] / 0.1 - log_denominator for p in positives) / len(positives)
        return total

    mine = base.clone().requires_grad_()
    supcon_loss(mine, labels, reduction="sum").backward()
    theirs = base.clone().requires_grad_()
    reference(theirs).backward()
    torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-6, atol=1e-9)
    assert torch.autograd.gradcheck(lambda x: supcon_loss(x, labels), (base.clone().requires_grad_(),))


def test_no_positives_is_zero_with_a_graph_and_no_nan():
    features = torch.randn(4, 3, requires_grad=True)
    loss = supcon_loss(features, torch.tensor([0, 1, 2, 3]))
    assert float(loss.detach()) == 0.0
    loss.backward()
    assert torch.equal(features.grad, torch.zeros_like(features))
    one = torch.randn(1, 3, requires_grad=True)
    supcon_loss(one, torch.tensor([0])).backward()
    assert torch.isfinite(one.grad).all()


def test_self_supervised_views_and_half_precision():
    generator = torch.Generator().manual_seed(4)
    features = torch.randn(4, 2, 8, generator=generator, dtype=torch.float64)
    rows = torch.cat([features[:, 0], features[:, 1]])
    expected, _ = eq2_reference(normalised(rows), list(range(4)) * 2, 0.1)
    assert float(supcon_loss(features, None, reduction="sum")) == pytest.approx(expected, rel=1e-6)
    labels = torch.tensor([0, 1, 0, 1])
    half = supcon_loss(features.to(torch.bfloat16), labels)
    assert half.dtype == torch.float32
    assert float(half) == pytest.approx(float(supcon_loss(features, labels)), rel=2e-2)


def test_bad_arguments_are_refused():
    with pytest.raises(EdgetrainError, match="labels for"):
        supcon_loss(torch.randn(4, 3), torch.tensor([0, 1, 2]))
    with pytest.raises(EdgetrainError, match="reduction"):
        supcon_loss(torch.randn(4, 3), torch.tensor([0, 1, 0, 1]), reduction="max")
    with pytest.raises(EdgetrainError, match="temperature"):
        supcon_loss(torch.randn(4, 3), torch.tensor([0, 1, 0, 1]), temperature=0)
    with pytest.raises(EdgetrainError, match="views"):
        supcon_loss(torch.randn(4, 3), None)
