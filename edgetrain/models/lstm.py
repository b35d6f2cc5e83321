"""LSTM text classifier over token ids [B, T].

Block view: embed = nn.Embedding ([B, T] -> [B, T, dim]), blocks = single-layer LSTMs stacked
([B, T, dim] -> [B, T, dim], states start at zero in every forward), head = mean over positions,
then Linear (or Linear-Tanh-Linear when `head_hidden` is set, the classifier SCPL uses).

Head: a mean over all T outputs rather than the last step. Inputs are fixed-length, unpadded
windows of a byte stream (the block view carries one tensor, so there is no length or mask), so
every position is real data; the mean gives each step a short path to the loss instead of a
T-step chain through the recurrence, which matters most to methods without end-to-end backprop.

A bidirectional block runs dim/2 units each way and concatenates them, so it still maps dim -> dim.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from edgetrain.models.llama import ConfigError
from edgetrain.models.mlp import check_positive_ints, seeded_build
from edgetrain.models.text_transformer import classifier
from edgetrain.models.zoo import MODEL_PRESETS


@dataclass
class LSTMConfig:
    vocab_size: int = 256  # byte-level tokens
    dim: int = 128
    num_layers: int = 2  # one block each
    bidirectional: bool = False
    num_classes: int = 4
    head_hidden: int | None = None  # None: Linear head; n: Linear(dim, n) - Tanh - Linear(n, classes)
    seed: int | None = 0  # weights are a function of the config; None draws from the global RNG

    def __post_init__(self) -> None:
        check_positive_ints(self, "vocab_size", "dim", "num_layers", "num_classes")
        if self.head_hidden is not None:
            check_positive_ints(self, "head_hidden")
        if self.bidirectional and self.dim % 2:
            raise ConfigError(f"LSTMConfig.dim = {self.dim}: must be even for a bidirectional LSTM "
                              "(dim/2 units each way)")


class LSTMBlock(nn.Module):
    """One LSTM layer over [B, T, dim]; the fused kernel when it can, an unrolled loop when it cannot.

    The fused CPU (oneDNN) and CUDA (cuDNN) LSTM kernels have no forward-mode AD, which the
    forward-gradient methods (FGD, AsyncFGD) need; `unrolled` computes the same function from the
    same weights with elementwise ops, one time step at a time. `force_unrolled` lets tests pin it.
    """

    force_unrolled = False

    def __init__(self, dim: int, bidirectional: bool) -> None:
        super().__init__()
        hidden = dim // 2 if bidirectional else dim
        self.lstm = nn.LSTM(dim, hidden, num_layers=1, batch_first=True, bidirectional=bidirectional)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.force_unrolled:
            return self.unrolled(h)
        try:
            return self.lstm(h)[0]
        except NotImplementedError:
            return self.unrolled(h)

    def unrolled(self, h: torch.Tensor) -> torch.Tensor:
        forward = self._scan(h, "")
        if not self.lstm.bidirectional:
            return forward
        backward = self._scan(h.flip(1), "_reverse").flip(1)
        return torch.cat([forward, backward], dim=-1)

    def _scan(self, x: torch.Tensor, suffix: str) -> torch.Tensor:
        lstm = self.lstm
        w_ih, w_hh = getattr(lstm, f"weight_ih_l0{suffix}"), getattr(lstm, f"weight_hh_l0{suffix}")
        bias = getattr(lstm, f"bias_ih_l0{suffix}") + getattr(lstm, f"bias_hh_l0{suffix}")
        x_gates = F.linear(x, w_ih, bias)  # the input part of every step in one matmul
        state = cell = x.new_zeros(x.shape[0], lstm.hidden_size)
        outputs = []
        for t in range(x.shape[1]):
            # PyTorch's gate order: input, forget, cell candidate, output.
            i, f, g, o = (x_gates[:, t] + F.linear(state, w_hh)).chunk(4, dim=-1)
            cell = torch.sigmoid(f) * cell + torch.sigmoid(i) * torch.tanh(g)
            state = torch.sigmoid(o) * torch.tanh(cell)
            outputs.append(state)
        return torch.stack(outputs, dim=1)


class MeanPoolHead(nn.Module):
    def __init__(self, dim: int, num_classes: int, hidden: int | None) -> None:
        super().__init__()
        self.fc = classifier(dim, num_classes, hidden)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.fc(h.mean(dim=1))


class LSTMClassifier(nn.Module):
    task = "classify"

    def __init__(self, config: LSTMConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.dim)
        self.blocks = nn.ModuleList(LSTMBlock(config.dim, config.bidirectional) for _ in range(config.num_layers))
        self.head = MeanPoolHead(config.dim, config.num_classes, config.head_hidden)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(token_ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def build_lstm(config: LSTMConfig) -> LSTMClassifier:
    """PyTorch default init: N(0, 1) embeddings, U(+-1/sqrt(hidden)) LSTM and Linear weights."""
    return seeded_build(config.seed, lambda: LSTMClassifier(config))


def lstm_text_config() -> LSTMConfig:
    """Byte-level 4-class classifier (AG News sized): 2 unidirectional LSTM layers of 128."""
    return LSTMConfig(vocab_size=256, dim=128, num_layers=2, bidirectional=False, num_classes=4)


@MODEL_PRESETS.register("lstm-text")
def lstm_text() -> LSTMClassifier:
    return build_lstm(lstm_text_config())
