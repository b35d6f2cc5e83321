"""A GGUF's `rope_freqs.weight` -> the Llama 3 RoPE scaling it encodes (LlamaConfig.rope_scaling).

llama.cpp's converter does not write Llama 3.1/3.2's `rope_scaling` parameters as metadata; it writes their
effect, one factor per rotary frequency (the frequency is divided by it): 1 for short wavelengths, `factor`
for long ones, and in between 1 / ((1 - s) / factor + s) with s = (context / wavelength - low) / (high - low)
(convert_hf_to_gguf.py, LlamaModel.generate_extra_tensors). The parameters are recovered from the factors
and checked by recomputing every factor the converter's way: the model then has exactly the file's
frequencies, and a checkpoint directory or merged GGUF written from it carries `rope_scaling` again.
Factors that no Llama 3 parameters make are refused by name rather than approximated.

The family is degenerate (scaling low, high and the context together changes no factor), so `low` is
taken as 1, Llama 3's value; with no factor strictly between 1 and `factor` the context is not determined
either, and the one that reproduces the factors at the largest power of two is chosen.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

# Relative agreement of a recomputed factor with the file's: the converter computes in float64 and stores
# float32 (one rounding, 6e-8), recomputing here in float64 adds less.
_TOLERANCE = 1e-6


def llama3_factors(theta: float, head_dim: int, factor: float, low: float, high: float, context: float) -> np.ndarray:
    """The factors convert_hf_to_gguf writes for these parameters, float32 (its arithmetic: frequencies in
    float32, the rest in Python floats)."""
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)))
    out = []
    for freq in freqs.astype(np.float32):
        wavelen = 2 * math.pi / float(freq)
        if wavelen < context / high:
            out.append(1.0)
        elif wavelen > context / low:
            out.append(factor)
        else:
            smooth = (context / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _wavelengths(theta: float, head_dim: int) -> np.ndarray:
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)))
    return 2 * math.pi / freqs.astype(np.float64)


def _candidates(factors: np.ndarray, wavelengths: np.ndarray, factor: float) -> list[tuple[float, float, float]]:
    """(low, high, context) to try, low = 1: from the factors strictly between 1 and `factor` (each gives
    s, and s is linear in 1 / wavelength), else Llama 3's high = 4 with a context between the wavelengths
    where the factors change."""
    smooths = [(w, (1 / f - 1 / factor) / (1 - 1 / factor)) for f, w in zip(factors, wavelengths) if 1 < f < factor]
    found: list[tuple[float, float, float]] = []
    for w, s in smooths:  # high = 4, Llama 3's: context = w (3 s + 1)
        found.append((1.0, 4.0, w * (3 * s + 1)))
    if len(smooths) >= 2:  # s = a / w + b: a = context / (high - low), b = -low / (high - low)
        (w1, s1), (w2, s2) = smooths[0], smooths[-1]
        a = (s1 - s2) / (1 / w1 - 1 / w2)
        b = s1 - a / w1
        if b < 0:
            high = round(1 - 1 / b, 4)  # the float32 factors fix it to about 1e-7: a config's value is round
            found.append((1.0, high, a * (high - 1)))
    if not smooths:
        # Every factor is 1 or `factor`: any context whose two boundaries fall between the same wavelengths
        # makes the same factors; prefer a power of two (Llama 3's 8192).
        ones = [w for f, w in zip(factors, wavelengths) if f == 1]
        scaled = [w for f, w in zip(factors, wavelengths) if f == factor]
        upper = min(scaled) if scaled else math.inf   # context / low must stay below the scaled wavelengths
        lower = 4.0 * max(ones) if ones else 0.0       # context / 4 must stay above the unscaled ones
        power = 2 ** math.floor(math.log2(upper)) if math.isfinite(upper) else 2 ** math.ceil(math.log2(lower))
        found.append((1.0, 4.0, float(power)))
    return found


def llama3_scaling_from_factors(factors: np.ndarray, theta: float, head_dim: int) -> dict[str, Any] | None:
    """LlamaConfig.rope_scaling for these factors, None when every factor is 1; ValueError (saying what is
    wrong with them) when no Llama 3 parameters make them."""
    factors = np.asarray(factors, dtype=np.float32).reshape(-1)
    if factors.shape != (head_dim // 2,):
        raise ValueError(f"holds {factors.size} factors; a head of {head_dim} rotates {head_dim // 2} frequencies")
    if not np.isfinite(factors).all() or (factors <= 0).any():
        raise ValueError("holds factors that are not finite and positive")
    if (factors == 1).all():
        return None
    factor = float(factors.max())
    wavelengths = _wavelengths(theta, head_dim)
    for low, high, context in _candidates(factors, wavelengths, factor):
        rounded = round(context)  # an integer, as config.json holds it
        if rounded <= 0 or high <= low:
            continue
        again = llama3_factors(theta, head_dim, factor, low, high, rounded)
        if np.allclose(again, factors, rtol=_TOLERANCE, atol=0):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": float(low),
                    "high_freq_factor": float(high), "original_max_position_embeddings": int(rounded)}
    raise ValueError(f"holds frequency factors (largest {factor:g}) that no Llama 3 RoPE scaling makes")
