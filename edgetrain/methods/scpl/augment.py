"""Two augmented views per image, on tensors (no torchvision, no downloads) -- SCPL appendix A.1.

A.1 follows Khosla et al.'s CIFAR recipe: random resized crop, random horizontal flip, colour jitter,
random grayscale, each image drawn twice so a batch of N becomes 2N. Here, per sample:

  crop       RandomResizedCrop: an area fraction in `crop_scale` (0.2-1) and aspect ratio in
             `crop_ratio` (3/4-4/3, log-uniform), ten tries then the whole image, resized back to
             the input size (bilinear, one batched grid_sample, no antialiasing);
  flip       horizontal, probability `flip` (0.5);
  jitter     with probability `jitter` (0.8): brightness, contrast, saturation factors uniform in
             [1-x, 1+x] (0.4 each) and a hue shift uniform in [-0.1, 0.1] of a turn, applied in that
             fixed order (torchvision draws the order at random); hue is a rotation of the chroma
             plane in YIQ space, the usual closed-form approximation of an HSV hue shift;
  grayscale  probability `grayscale` (0.2): luminance (ITU-R 601) in every channel.

Saturation, hue and grayscale act on 3-channel images only (a 1-channel image has no colour).
Images whose values lie in [0, 1] are clamped back into it after each colour op, as torchvision does
for float images; others (already normalised) are left unclamped.

Randomness comes from the caller's torch.Generator, so a view is a pure function of (seed, batch
index): a resumed run and every pipeline rank draw the same views as the uninterrupted run.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F

from edgetrain.registry import EdgetrainError

LUMA = (0.299, 0.587, 0.114)
CROP_TRIES = 10


@dataclass(frozen=True)
class AugmentConfig:
    crop_scale: tuple[float, float] = (0.2, 1.0)
    crop_ratio: tuple[float, float] = (3 / 4, 4 / 3)
    flip: float = 0.5
    jitter: float = 0.8
    brightness: float = 0.4
    contrast: float = 0.4
    saturation: float = 0.4
    hue: float = 0.1
    grayscale: float = 0.2

    def __post_init__(self) -> None:
        object.__setattr__(self, "crop_scale", tuple(float(v) for v in self.crop_scale))
        object.__setattr__(self, "crop_ratio", tuple(float(v) for v in self.crop_ratio))
        low, high = self.crop_scale
        if not 0 < low <= high <= 1:
            raise EdgetrainError(f"augment: crop_scale {self.crop_scale} must satisfy 0 < low <= high <= 1")
        if not 0 < self.crop_ratio[0] <= self.crop_ratio[1]:
            raise EdgetrainError(f"augment: crop_ratio {self.crop_ratio} must satisfy 0 < low <= high")
        for name in ("flip", "jitter", "grayscale"):
            if not 0 <= getattr(self, name) <= 1:
                raise EdgetrainError(f"augment: {name} is a probability, got {getattr(self, name)}")
        for name in ("brightness", "contrast", "saturation"):
            if not 0 <= getattr(self, name) < 1:
                raise EdgetrainError(f"augment: {name} must be in [0, 1), got {getattr(self, name)}")
        if not 0 <= self.hue <= 0.5:
            raise EdgetrainError(f"augment: hue must be in [0, 0.5], got {self.hue}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def augment_config(value: AugmentConfig | dict[str, Any] | None) -> AugmentConfig:
    """None -> appendix A.1's recipe; a dict overrides some of its fields."""
    if value is None:
        return AugmentConfig()
    if isinstance(value, AugmentConfig):
        return value
    if isinstance(value, dict):
        known = {f.name for f in fields(AugmentConfig)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise EdgetrainError(f"augment: unknown setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return AugmentConfig(**value)
    raise EdgetrainError(f"augment: expected a dict of settings or AugmentConfig, got {type(value).__name__}")


def _uniform(generator: torch.Generator, n: int, low: float, high: float) -> torch.Tensor:
    return low + (high - low) * torch.rand(n, generator=generator)


def _crop_boxes(generator: torch.Generator, n: int, height: int, width: int,
                config: AugmentConfig) -> torch.Tensor:
    """[n, 4] boxes (top, left, h, w) in pixels, drawn as torchvision's RandomResizedCrop.get_params."""
    area = height * width
    scale = _uniform(generator, n * CROP_TRIES, *config.crop_scale).view(n, CROP_TRIES) * area
    log_ratio = _uniform(generator, n * CROP_TRIES, math.log(config.crop_ratio[0]),
                         math.log(config.crop_ratio[1])).view(n, CROP_TRIES)
    ratio = torch.exp(log_ratio)
    w = torch.round(torch.sqrt(scale * ratio))
    h = torch.round(torch.sqrt(scale / ratio))
    ok = (w > 0) & (w <= width) & (h > 0) & (h <= height)
    # First valid try per sample; the whole image when none is.
    first = torch.where(ok.any(dim=1), ok.float().argmax(dim=1), torch.full((n,), -1))
    rows = torch.arange(n)
    pick = first.clamp(min=0)
    h = torch.where(first >= 0, h[rows, pick], torch.full((n,), float(height)))
    w = torch.where(first >= 0, w[rows, pick], torch.full((n,), float(width)))
    top = torch.floor(torch.rand(n, generator=generator) * (height - h + 1))
    left = torch.floor(torch.rand(n, generator=generator) * (width - w + 1))
    return torch.stack([top, left, h, w], dim=1)


def _resized_crop_and_flip(images: torch.Tensor, boxes: torch.Tensor, flip: torch.Tensor) -> torch.Tensor:
    """Crop every image to its box and resize it back to [H, W] in one batched grid_sample."""
    n, _, height, width = images.shape
    top, left, h, w = boxes.to(images.device, images.dtype).unbind(1)
    sign = torch.where(flip.to(images.device), -1.0, 1.0).to(images.dtype)
    theta = torch.zeros(n, 2, 3, dtype=images.dtype, device=images.device)
    # Normalised coordinates (align_corners=False): pixel edge 0 is -1, edge W is +1.
    theta[:, 0, 0] = sign * w / width
    theta[:, 0, 2] = (2 * left + w) / width - 1
    theta[:, 1, 1] = h / height
    theta[:, 1, 2] = (2 * top + h) / height - 1
    grid = F.affine_grid(theta, list(images.shape), align_corners=False)
    return F.grid_sample(images, grid, mode="bilinear", padding_mode="border", align_corners=False)


def _gray(images: torch.Tensor) -> torch.Tensor:
    r, g, b = images[:, 0:1], images[:, 1:2], images[:, 2:3]
    return LUMA[0] * r + LUMA[1] * g + LUMA[2] * b


def _per_sample(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return values.to(like.device, like.dtype).view(-1, 1, 1, 1)


def _hue_shift(images: torch.Tensor, turns: torch.Tensor) -> torch.Tensor:
    """Rotate the chroma (I, Q) plane of YIQ by `turns` of a full circle."""
    to_yiq = images.new_tensor([[0.299, 0.587, 0.114], [0.596, -0.274, -0.322], [0.211, -0.523, 0.312]])
    yiq = torch.einsum("ij,njhw->nihw", to_yiq, images)
    angle = 2 * math.pi * turns.to(images.device, images.dtype)
    cos, sin = _per_sample(torch.cos(angle), images), _per_sample(torch.sin(angle), images)
    i, q = yiq[:, 1:2], yiq[:, 2:3]
    yiq = torch.cat([yiq[:, 0:1], cos * i - sin * q, sin * i + cos * q], dim=1)
    return torch.einsum("ij,njhw->nihw", torch.linalg.inv(to_yiq), yiq)


def augment_images(images: torch.Tensor, generator: torch.Generator,
                   config: AugmentConfig | None = None) -> torch.Tensor:
    """One augmented view of every image in [N, C, H, W]; every random draw from `generator` (CPU)."""
    config = config or AugmentConfig()
    if images.dim() != 4:
        raise EdgetrainError(f"augment_images: expected [N, C, H, W], got shape {tuple(images.shape)}")
    n, channels, height, width = images.shape
    with torch.no_grad():
        clamp = bool(images.min() >= 0) and bool(images.max() <= 1)
        # Every draw is made for every sample, used or not, so the stream of draws is fixed by N alone.
        boxes = _crop_boxes(generator, n, height, width, config)
        flip = torch.rand(n, generator=generator) < config.flip
        jitter = torch.rand(n, generator=generator) < config.jitter
        brightness = _uniform(generator, n, 1 - config.brightness, 1 + config.brightness)
        contrast = _uniform(generator, n, 1 - config.contrast, 1 + config.contrast)
        saturation = _uniform(generator, n, 1 - config.saturation, 1 + config.saturation)
        hue = _uniform(generator, n, -config.hue, config.hue)
        grayscale = torch.rand(n, generator=generator) < config.grayscale
        one = torch.ones(n)

        out = _resized_crop_and_flip(images, boxes, flip)

        def finish(x: torch.Tensor) -> torch.Tensor:
            return x.clamp(0, 1) if clamp else x

        out = finish(out * _per_sample(torch.where(jitter, brightness, one), out))
        gray = _gray(out) if channels == 3 else out
        mean = gray.mean(dim=(1, 2, 3), keepdim=True)
        out = finish((out - mean) * _per_sample(torch.where(jitter, contrast, one), out) + mean)
        if channels == 3:
            gray = _gray(out)
            out = finish((out - gray) * _per_sample(torch.where(jitter, saturation, one), out) + gray)
            if config.hue > 0:
                out = finish(_hue_shift(out, torch.where(jitter, hue, torch.zeros(n))))
            out = torch.where(_per_sample(grayscale, out).bool(), _gray(out).expand_as(out), out)
    return out


def view_generator(seed: int, batch_index: int, view: int) -> torch.Generator:
    """The generator of one view of one batch: a pure function of the three numbers."""
    return torch.Generator().manual_seed((int(seed) * 1_000_003 + int(batch_index)) * 31 + int(view))


def make_views(inputs: torch.Tensor, targets: torch.Tensor, *, num_views: int, image_shape: tuple[int, ...] | None,
               seed: int, batch_index: int, config: AugmentConfig | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs of all views, view-major: view 0 of every sample, then view 1 ...; targets repeated).

    num_views=1 returns the batch unchanged (no augmentation: the text setting). Flat inputs are
    viewed as `image_shape` for augmenting and flattened back."""
    if num_views == 1:
        return inputs, targets
    if image_shape is None:
        raise EdgetrainError("two views need images: the model's config gives no image shape (C, H, W)")
    per_sample = tuple(inputs.shape[1:])
    if math.prod(per_sample) != math.prod(image_shape):
        raise EdgetrainError(f"inputs of shape {tuple(inputs.shape)} do not hold {tuple(image_shape)} images")
    images = inputs.reshape(inputs.shape[0], *image_shape)
    views = [augment_images(images, view_generator(seed, batch_index, v), config).reshape(inputs.shape)
             for v in range(num_views)]
    return torch.cat(views, dim=0), targets.repeat(num_views)
