"""The unit a stream yields: one batch of inputs and targets."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Batch:
    """inputs: token ids [B, T] (int64) for language models and text classifiers, features [B, ...]
    (float) otherwise, shaped as the model's config says (`input_shape`, `in_channels`, `image_size`).

    targets (int64): for language models the next-token ids [B, T] aligned with `inputs`
    (targets[:, t] is the token after inputs[:, t]; -100 marks positions without a target);
    for classifiers the class ids [B].
    `index` (a non-negative int) is the batch's position in its stream, used in error messages and
    for resuming. The container checks nothing itself: `edgetrain.data.validate_batch` does, and the
    learner runs it on every batch before training on it.
    """

    inputs: torch.Tensor
    targets: torch.Tensor
    index: int = 0

    @property
    def num_samples(self) -> int:
        return int(self.inputs.shape[0])

    @property
    def num_tokens(self) -> int:
        """Tokens that carry a target (LM) or samples (classification)."""
        if self.targets.dim() >= 2:
            return int((self.targets != -100).sum())
        return self.num_samples

    def to(self, device: torch.device | str) -> "Batch":
        return Batch(self.inputs.to(device), self.targets.to(device), self.index)
