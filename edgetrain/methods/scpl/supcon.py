"""The supervised contrastive loss of Khosla et al. (2020), as SCPL's Eq. (2) writes it.

For a batch of projected features z_1 .. z_M (M = N samples x V views, each row L2-normalised):

    L = sum_i  -1/|P(i)|  sum_{p in P(i)}  log( exp(z_i . z_p / tau) / sum_{j != i} exp(z_i . z_j / tau) )

P(i) is every *other* row with the anchor's label -- with two views, the anchor's other view is one of
them (it has the same label). The anchor itself is in neither P(i) nor the denominator. An anchor
without positives (a class with a single sample in a one-view batch) has no term: Eq. (2) is undefined
for it, and it is skipped rather than divided by zero.

reduction="sum" is Eq. (2) as printed; "mean" (the default) divides by the number of anchors that have
a term, which is what Khosla et al.'s code and the SCPL pseudo-code (Algorithm 1) optimise: a loss
whose scale does not grow with the batch, so one learning rate fits every batch size.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from edgetrain.registry import EdgetrainError

DEFAULT_TEMPERATURE = 0.1
REDUCTIONS = ("mean", "sum", "none")


def supcon_loss(features: torch.Tensor, labels: torch.Tensor | None = None, *,
                temperature: float = DEFAULT_TEMPERATURE, reduction: str = "mean",
                normalize: bool = True) -> torch.Tensor:
    """Supervised contrastive loss of `features` [M, D], or [N, V, D] for V views of N samples.

    labels: [N] class ids (repeated over the views); None makes the views of one sample the only
    positives (SimCLR's self-supervised case; needs V >= 2). With [M, D] features and labels [M], rows
    are anchors in the given order, so two views concatenated along the batch (labels repeated) are the
    same as [N, 2, D]. reduction="none" gives the per-anchor terms [M] (0 where an anchor has no
    positive). Half-precision features are computed in float32.
    """
    if reduction not in REDUCTIONS:
        raise EdgetrainError(f"supcon_loss: reduction must be one of {', '.join(REDUCTIONS)}, got {reduction!r}")
    if not temperature > 0:
        raise EdgetrainError(f"supcon_loss: temperature must be positive, got {temperature}")
    if features.dim() == 3:
        num_samples, num_views = features.shape[:2]
        # View-major rows: all samples' view 0, then view 1, ... (the order of torch.cat over views).
        z = features.transpose(0, 1).reshape(num_samples * num_views, features.shape[-1])
    elif features.dim() == 2:
        num_samples, num_views = features.shape[0], 1
        z = features
    else:
        raise EdgetrainError(f"supcon_loss: features must be [M, D] or [N, V, D], got shape {tuple(features.shape)}")
    rows = z.shape[0]
    if labels is None:
        if features.dim() != 3 or num_views < 2:
            raise EdgetrainError("supcon_loss: without labels the positives are the other views of a sample; "
                                 "pass features [N, V>=2, D]")
        groups = torch.arange(num_samples, device=z.device).repeat(num_views)
    else:
        labels = labels.reshape(-1).to(z.device)
        if labels.numel() == num_samples and num_views > 1:
            labels = labels.repeat(num_views)
        if labels.numel() != rows:
            raise EdgetrainError(f"supcon_loss: {labels.numel()} labels for {rows} feature rows")
        groups = labels
    if z.dtype not in (torch.float32, torch.float64):
        z = z.float()  # half precision: the logits and their log-sum-exp in float32
    if rows < 2:  # one row has no other row: no denominator, no term (and no NaN gradient)
        zero = z.sum() * 0.0
        return zero.reshape(1).expand(rows) if reduction == "none" else zero
    if normalize:
        z = F.normalize(z, dim=1)
    logits = z @ z.T / temperature
    self_mask = torch.eye(rows, dtype=torch.bool, device=z.device)
    # log of the denominator: every row but the anchor's own.
    log_denominator = torch.logsumexp(logits.masked_fill(self_mask, float("-inf")), dim=1, keepdim=True)
    log_prob = logits - log_denominator
    positives = (groups[:, None] == groups[None, :]) & ~self_mask
    counts = positives.sum(dim=1)
    per_anchor = -torch.where(positives, log_prob, torch.zeros_like(log_prob)).sum(dim=1) / counts.clamp(min=1)
    if reduction == "none":
        return per_anchor
    if reduction == "sum":
        return per_anchor.sum()
    has_term = counts > 0
    if not bool(has_term.any()):  # no anchor has a positive: nothing to pull together (keeps the graph)
        return per_anchor.sum() * 0.0
    return per_anchor[has_term].mean()
