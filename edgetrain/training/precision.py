"""The dtype that reductions (RMSNorm's mean square, softmax, cross-entropy) are computed in.

At least fp32, because bf16/fp16 sums lose too much and the reference implementations normalise in fp32
(so bf16 models match them); the input's own dtype when it is wider, so that an fp64 model is a true
fp64 reference instead of an fp32 computation stored in fp64.
"""
from __future__ import annotations

import torch


def compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """The widest of fp32 and the given dtypes: bf16 -> fp32, fp32 -> fp32, fp64 -> fp64."""
    result = torch.float32
    for dtype in dtypes:
        result = torch.promote_types(result, dtype)
    return result
