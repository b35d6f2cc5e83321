"""`edgetrain.add_lora` and `edgetrain.save_lora` for a model of any framework: a torch model gets
edgetrain.models.lora's, a model of another framework (an MLX decoder, which names its framework in a
`framework` attribute) its backend's LoRA, and its adapters are written in edgetrain's one-file format,
which every backend loads."""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from edgetrain.backends.base import backend_for_model
from edgetrain.models import lora
from edgetrain.models.lora import LoraConfig


def add_lora(model: Any, config: LoraConfig | None = None, **overrides: Any) -> Any:
    """Freeze every weight of `model` and wrap the target linears of each block with LoRA (in place)."""
    backend = backend_for_model(model)
    if backend is None:
        return lora.add_lora(model, config, **overrides)
    return backend.adapter_functions()[0](model, config, **overrides)


def save_lora(model: Any, path: str | Path) -> Path:
    """Write only the adapter weights (safetensors, atomically) with the LoRA config in its metadata."""
    backend = backend_for_model(model)
    if backend is None:
        return lora.save_lora(model, path)
    from edgetrain.adapters.convert import convert_adapter

    with tempfile.TemporaryDirectory(prefix="edgetrain-lora-") as scratch:
        written = backend.adapter_functions()[1](model, Path(scratch) / "adapter")
        return convert_adapter(written, path, "edgetrain")
