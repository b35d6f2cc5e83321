"""Seeded random tangents for the forward-gradient methods (`fgd`, `asyncfgd`).

A tangent u is a Gaussian direction in parameter space. The forward pass carries the JVP along u;
the update needs the same u again. Keeping u from the forward to the update costs a parameter-sized
tensor per sample in flight, so by default a tangent is never kept: it is a pure function of its
key and is drawn again, bit for bit, when the update needs it ("tangent checkpoint", AsyncFGD §4.2).

The key of a parameter's tangent is (run seed, sample, module, draw, parameter index):
  sample -- the iteration at which the sample entered the pipeline (never the current step: in a
            K-module pipeline, module k updates at step t with the sample that entered K-1 steps
            earlier and must draw exactly the tangent it used for it then);
  module -- the pipeline module that perturbs the parameter;
  draw   -- which of the step's tangents (several per step can be averaged to lower the variance);
  parameter index -- the parameter's position among the model's trainable parameters.
Each parameter gets its own generator seeded from the mixed key, so one parameter's tangent can be
drawn without drawing the ones before it (no RNG offsets to track) and only one parameter's
tangent needs to be alive at a time.

`alpha` scales tangents per parameter group (AsyncFGD §4.2, efficient transfer learning): the
estimate's expectation becomes alpha^2 times the gradient; alpha = 0 freezes a parameter (no
perturbation, no update) while JVPs from earlier modules still pass through it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

import torch

from edgetrain.registry import EdgetrainError

_MASK64 = (1 << 64) - 1

AlphaSpec = float | Mapping[str, float]


def _splitmix64(value: int) -> int:
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def mix_seed(*parts: int) -> int:
    """A 63-bit seed from integers; nearby keys give unrelated seeds (splitmix64 chained over the parts)."""
    state = 0
    for part in parts:
        state = _splitmix64(state ^ (int(part) & _MASK64))
    return state >> 1  # torch.Generator.manual_seed takes values below 2**63 without wrapping


@dataclass(frozen=True)
class TangentKey:
    """What identifies the tangents of one module for one sample and one draw."""

    seed: int
    sample: int
    module: int
    draw: int = 0

    def parameter_seed(self, parameter_index: int) -> int:
        return mix_seed(self.seed, self.sample, self.module, self.draw, parameter_index)


def draw_tangent(like: torch.Tensor, seed: int, alpha: float = 1.0) -> torch.Tensor:
    """alpha * N(0, I) shaped like `like` (same dtype and device), from a generator seeded with `seed`."""
    generator = torch.Generator(device=like.device).manual_seed(seed)
    tangent = torch.randn(like.shape, generator=generator, device=like.device, dtype=like.dtype)
    if alpha != 1.0:
        tangent.mul_(alpha)
    return tangent


def resolve_alpha(spec: AlphaSpec, names: Iterable[str]) -> dict[str, float]:
    """Per-parameter alpha from a float (every parameter) or {name prefix: alpha} (the longest
    matching prefix wins; "" is the default, 1.0 when absent). Prefixes follow module boundaries:
    "blocks.1" matches "blocks.1.weight", not "blocks.10.weight"."""
    names = list(names)
    if _is_number(spec):
        table = {"": float(spec)}
    elif isinstance(spec, Mapping):
        for key, value in spec.items():
            if not isinstance(key, str) or not _is_number(value):
                raise EdgetrainError(f"alpha[{key!r}] = {value!r}: alpha maps parameter-name prefixes (strings) "
                                     "to numbers")
        table = {k: float(v) for k, v in spec.items()}
    else:
        raise EdgetrainError(f"alpha must be a number or a {{name prefix: number}} dict, got {spec!r} "
                             f"({type(spec).__name__})")
    for prefix, value in table.items():
        if not 0.0 <= value <= 1.0 or value != value:
            raise EdgetrainError(f"alpha[{prefix!r}] = {value}: must be in [0, 1]")
        if prefix and not any(_matches(name, prefix) for name in names):
            raise EdgetrainError(f"alpha prefix {prefix!r} matches no trainable parameter")
    resolved = {}
    for name in names:
        best = max((p for p in table if _matches(name, p)), key=len, default=None)
        resolved[name] = table[best] if best is not None else 1.0
    return resolved


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _matches(name: str, prefix: str) -> bool:
    return prefix == "" or name == prefix or name.startswith(prefix + ".")


class TangentBank:
    """Hands out tangents for the forward and again for the update.

    checkpoint=True (default): nothing is stored; the update draws the tangent again from its key.
    checkpoint=False: the tangent drawn for the forward is kept until its update takes it -- the
    "Async without tangent checkpoint" variant of the paper's Fig. 3, kept for memory comparisons.
    Both give bit-identical tangents, so both give the same weights.
    """

    def __init__(self, parameter_index: Mapping[str, int], alpha: Mapping[str, float],
                 checkpoint: bool = True) -> None:
        self.parameter_index = dict(parameter_index)
        self.alpha = dict(alpha)
        self.checkpoint = checkpoint
        self._kept: dict[tuple[TangentKey, str], torch.Tensor] = {}

    def perturbed(self, name: str) -> bool:
        return self.alpha[name] != 0.0

    def draw(self, key: TangentKey, name: str, like: torch.Tensor) -> torch.Tensor:
        return draw_tangent(like, key.parameter_seed(self.parameter_index[name]), self.alpha[name])

    def for_forward(self, key: TangentKey, name: str, like: torch.Tensor) -> torch.Tensor:
        tangent = self.draw(key, name, like)
        if not self.checkpoint:
            self._kept[(key, name)] = tangent
        return tangent

    def for_update(self, key: TangentKey, name: str, like: torch.Tensor, consume: bool = True) -> torch.Tensor:
        """The tangent the forward used; the caller may overwrite it (it is not used again).
        consume=False (checking an update before making it): a kept tangent stays kept, and the caller
        must not overwrite what it gets."""
        if self.checkpoint:
            return self.draw(key, name, like)
        try:
            return self._kept.pop((key, name)) if consume else self._kept[(key, name)]
        except KeyError:
            raise EdgetrainError(f"no kept tangent for {name} at {key}; was its forward run?") from None

    def keep_again(self, key: TangentKey, name: str, like: torch.Tensor) -> None:
        """Refill the store after a resume (without checkpointing, in-flight tangents are state)."""
        if not self.checkpoint:
            self._kept[(key, name)] = self.draw(key, name, like)

    def release(self, key: TangentKey) -> None:
        """Drop what is kept for `key` (a step that stopped before its update)."""
        for kept_key in [k for k in self._kept if k[0] == key]:
            del self._kept[kept_key]

    def clear(self) -> None:
        self._kept.clear()

    def kept_tensors(self) -> list[torch.Tensor]:
        return list(self._kept.values())

    def kept_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._kept.values())
