"""One options dataclass per method, shared by its torch and MLX implementations and validated once.

`Learner(method="mesp", method_options={...})` hands the options to the method of the learner's
framework (registries: edgetrain.methods.METHODS for torch, edgetrain.backends.mlx.methods.MLX_METHODS);
both build the same config here, so an option means the same thing, has the same default and is
refused for the same reason on either. An unknown option is an error naming the known ones.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

from edgetrain.methods.options import flag_option, int_option, positive_int_option, positive_number_option
from edgetrain.registry import EdgetrainError


def _checked(check: Callable[[str, str, Any], Any], default: Any, optional: bool = False) -> Any:
    return field(default=default, metadata={"check": check, "optional": optional})


@dataclass(frozen=True)
class MeSPConfig:
    """mesp (edgetrain/methods/mesp/method.py says what each does)."""

    fused_update: bool = _checked(flag_option, False)
    # with fused_update: keep a copy of the adapters and optimizer state during a step, so a non-finite
    # gradient found half-way restores the last good step
    rollback: bool = _checked(flag_option, True)
    store_lora_projection: bool = _checked(flag_option, False)   # the paper's Table 5 "store" ablation
    attention_chunk: int = _checked(positive_int_option, 64)     # query rows per attention chunk
    mlp_chunk: int = _checked(positive_int_option, 256)          # tokens per MLP chunk
    loss_chunk: int = _checked(positive_int_option, 256)         # tokens per loss chunk
    # vocabulary rows per loss tile; None: 4096, or 512 for a quantised head on a CPU (torch)
    vocab_chunk: int | None = _checked(positive_int_option, None, optional=True)
    # torch on a CPU: a step's large temporaries reuse buffers whose tensors are gone (mesp/step_buffers.py);
    # the same numbers, without a page fault per fresh temporary. MLX's allocator caches its own buffers.
    reuse_buffers: bool = _checked(flag_option, True)
    # torch: run each block's forward and backward as programs compiled once for all blocks (mesp/compiled.py);
    # not built for MLX, which refuses it
    compile_blocks: bool = _checked(flag_option, False)


@dataclass(frozen=True)
class MeZOConfig:
    """mezo: the perturbation's scale and the seed its directions are drawn from."""

    epsilon: float = _checked(positive_number_option, 1e-3)
    seed: int = _checked(int_option, 0)


METHOD_CONFIGS: dict[str, type] = {"mesp": MeSPConfig, "mezo": MeZOConfig}


def method_config(method: str, options: dict[str, Any]) -> Any:
    """`options` checked into `method`'s config: unknown names and bad values are EdgetrainErrors."""
    config_class = METHOD_CONFIGS[method]
    fields = {f.name: f for f in dataclasses.fields(config_class)}
    unknown = sorted(set(options) - set(fields))
    if unknown:
        raise EdgetrainError(f"{method}: unknown option(s) {', '.join(unknown)}; known: {', '.join(fields)}")
    checked = {}
    for name, value in options.items():
        spec = fields[name].metadata
        checked[name] = None if value is None and spec["optional"] else spec["check"](method, name, value)
    return config_class(**checked)
