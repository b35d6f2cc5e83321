"""One adapter, every format: detect which format a path holds and convert between edgetrain's file,
PEFT directories and mlx-lm directories. edgetrain's file is the hub: every conversion reads the source
into (config, tensors under edgetrain's names) and writes the target from that, so the weights are
copied exactly (mlx-lm stores them transposed, in float32)."""
from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from edgetrain.models.lora import AdapterError, LoraConfig, read_lora_file, write_lora_file

from edgetrain.adapters.formats import FORMATS  # noqa: E402  (re-exported)


def detect_format(path: str | Path) -> str:
    """Which format `path` holds: an edgetrain .safetensors file, or a PEFT or mlx-lm directory."""
    from edgetrain.adapters.peft import is_peft_adapter

    path = Path(path)
    if path.is_file():
        return "edgetrain"
    if is_peft_adapter(path):
        return "peft"
    if path.is_dir() and (path / "adapter_config.json").is_file():
        return "mlx-lm"
    what = "does not exist" if not path.exists() else "is neither an adapter file nor an adapter directory"
    raise AdapterError(f"{path} {what} (formats: an edgetrain .safetensors file, a PEFT or an mlx-lm directory)")


def _read_edgetrain(path: Path) -> tuple[LoraConfig, dict[str, torch.Tensor]]:
    return read_lora_file(path)


def _write_edgetrain(config: LoraConfig, tensors: dict[str, torch.Tensor], path: Path, base_model: str | None) -> Path:
    return write_lora_file(config, tensors, path)


def _mlx_adapters():
    try:
        from edgetrain.backends.mlx import adapters
    except ImportError as exc:
        raise AdapterError(f"mlx-lm adapters need mlx (pip install 'edgetrain[mlx]'): {exc}") from None
    return adapters


def _read_mlx_lm(path: Path) -> tuple[LoraConfig, dict[str, torch.Tensor]]:
    with tempfile.TemporaryDirectory() as tmp:
        file = _mlx_adapters().mlx_lm_to_torch_adapter(path, Path(tmp) / "adapter.safetensors")
        return _read_edgetrain(file)


def _write_mlx_lm(config: LoraConfig, tensors: dict[str, torch.Tensor], path: Path, base_model: str | None) -> Path:
    with tempfile.TemporaryDirectory() as tmp:
        file = _write_edgetrain(config, tensors, Path(tmp) / "adapter.safetensors", base_model)
        return _mlx_adapters().torch_adapter_to_mlx_lm(file, path)


def _read_peft(path: Path) -> tuple[LoraConfig, dict[str, torch.Tensor]]:
    from edgetrain.adapters.peft import read_peft_adapter

    config, tensors, _ = read_peft_adapter(path)
    return config, tensors


def _write_peft(config: LoraConfig, tensors: dict[str, torch.Tensor], path: Path, base_model: str | None) -> Path:
    from edgetrain.adapters.peft import write_peft_adapter

    return write_peft_adapter(config, tensors, path, base_model)


READERS: dict[str, Callable[[Path], tuple[LoraConfig, dict[str, torch.Tensor]]]] = {
    "edgetrain": _read_edgetrain, "peft": _read_peft, "mlx-lm": _read_mlx_lm}
WRITERS: dict[str, Callable[[LoraConfig, dict[str, torch.Tensor], Path, str | None], Path]] = {
    "edgetrain": _write_edgetrain, "peft": _write_peft, "mlx-lm": _write_mlx_lm}


def read_adapter(path: str | Path) -> tuple[LoraConfig, dict[str, torch.Tensor]]:
    """(config, tensors under edgetrain's names) of an adapter in any of FORMATS."""
    return READERS[detect_format(path)](Path(path))


def convert_adapter(source: str | Path, target: str | Path, target_format: str, base_model: str | None = None) -> Path:
    """Write the adapter at `source` (any format) to `target` in `target_format`, atomically."""
    if target_format not in WRITERS:
        raise AdapterError(f"unknown adapter format {target_format!r}; known: {', '.join(FORMATS)}")
    if Path(source).resolve() == Path(target).resolve():
        raise AdapterError(f"{target}: the output would replace the adapter being read")
    config, tensors = read_adapter(source)
    return WRITERS[target_format](config, tensors, Path(target), base_model)


def load_adapter(model: torch.nn.Module, path: str | Path) -> torch.nn.Module:
    """Load an adapter of any format into a torch model (all or nothing, as edgetrain.load_lora)."""
    from edgetrain.models.lora import install_adapter

    config, tensors = read_adapter(path)
    return install_adapter(model, config, tensors, path)


def load_adapter_into_mlx(model, path: str | Path):
    """An adapter of any format into an MLX model: mlx-lm directories load as they are, the others through
    an exact conversion to mlx-lm (the MLX backend's adapter loader)."""
    adapters = _mlx_adapters()
    if detect_format(path) == "mlx-lm":
        return adapters.load_mlx_lm_adapters(model, path)
    with tempfile.TemporaryDirectory() as tmp:
        return adapters.load_mlx_lm_adapters(model, convert_adapter(path, Path(tmp) / "adapter", "mlx-lm"))
