"""Putting weights into an MLX decoder: the dtype names edgetrain accepts, and strict assignment (every
parameter present with its shape, nothing unknown). Shared by the checkpoint and the GGUF loaders."""
from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from edgetrain.models.hf_checkpoint import CheckpointError
from edgetrain.registry import EdgetrainError

_DTYPES = {"float32": mx.float32, "fp32": mx.float32, "bfloat16": mx.bfloat16, "bf16": mx.bfloat16,
           "float16": mx.float16, "fp16": mx.float16}


def parse_mlx_dtype(dtype: str | mx.Dtype) -> mx.Dtype:
    if isinstance(dtype, mx.Dtype):
        return dtype
    try:
        return _DTYPES[str(dtype).removeprefix("torch.")]
    except KeyError:
        raise EdgetrainError(f"unknown dtype {dtype!r}; known: {', '.join(_DTYPES)}") from None


def assign_weights(model: nn.Module, tensors: dict[str, mx.array], source: str) -> None:
    """Strict assignment: every parameter present with its shape; unknown tensors are an error."""
    expected = dict(tree_flatten(model.parameters()))
    tied = {"head.lm_head.weight"} if model.config.tie_word_embeddings else set()
    values = []
    for name, array in tensors.items():
        if name in tied:
            continue
        if name not in expected:
            raise CheckpointError(f"{source}: tensor {name!r} does not belong to a {type(model).__name__}")
        if tuple(array.shape) != tuple(expected[name].shape):
            raise CheckpointError(f"{source}: tensor {name!r} has shape {tuple(array.shape)}, "
                                  f"the model expects {tuple(expected[name].shape)}")
        if mx.issubdtype(expected[name].dtype, mx.floating) and not mx.issubdtype(array.dtype, mx.floating):
            raise CheckpointError(f"{source}: tensor {name!r} holds {array.dtype} values; the model's weights "
                                  "are floating point")
        values.append((name, array))
    present = {name for name, _ in values}
    missing = [k for k in expected if k not in present]
    if missing:
        raise CheckpointError(f"{source}: missing tensor(s) {', '.join(missing[:5])}"
                              + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    model.update(tree_unflatten(values))
    mx.eval(model.parameters())
