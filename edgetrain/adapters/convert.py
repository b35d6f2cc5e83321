"""One adapter, every format: detect which format a path holds and convert between edgetrain's file,
PEFT directories, mlx-lm directories and llama.cpp's LoRA GGUF. edgetrain's file is the hub: every
conversion reads the source into (config, tensors under edgetrain's names) and writes the target from
that, so the weights are copied exactly (mlx-lm stores them transposed, GGUF with llama's Q/K rows
permuted; both in float32).

A GGUF adapter names tensors after its base model's layout, so reading or writing one needs the base
model's config (`AdapterBase`); the other formats are self-contained."""
from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from edgetrain.adapters.formats import FORMATS  # noqa: F401  (re-exported)
from edgetrain.files.space import check_free_space, tensor_bytes
from edgetrain.models.llama import LlamaConfig
from edgetrain.models.lora import AdapterError, LoraConfig, check_adapter_names, read_lora_file, write_lora_file


@dataclass(frozen=True)
class AdapterBase:
    """What a conversion knows of the base model: its name (recorded in PEFT and GGUF adapters) and its
    config (needed to read or write GGUF adapters, and to check that an adapter fits)."""
    name: str | None = None
    config: LlamaConfig | None = None

    def require_config(self, why: str) -> LlamaConfig:
        if self.config is None:
            raise AdapterError(f"{why} needs the base model (--model, or load_adapter into a model)")
        return self.config


def detect_format(path: str | Path) -> str:
    """Which format `path` holds: an edgetrain .safetensors file, or a PEFT or mlx-lm directory."""
    from edgetrain.adapters.gguf_lora import is_gguf_file
    from edgetrain.adapters.peft import is_peft_adapter

    path = Path(path)
    if is_gguf_file(path):
        return "gguf"
    if path.is_file():
        return "edgetrain"
    if is_peft_adapter(path):
        return "peft"
    if path.is_dir() and (path / "adapter_config.json").is_file():
        return "mlx-lm"
    what = "does not exist" if not path.exists() else "is neither an adapter file nor an adapter directory"
    raise AdapterError(f"{path} {what} (formats: an edgetrain .safetensors file, a llama.cpp .gguf adapter, a PEFT or an mlx-lm directory)")


Tensors = dict[str, torch.Tensor]


def _read_edgetrain(path: Path, base: AdapterBase) -> tuple[LoraConfig, Tensors]:
    return read_lora_file(path)


def _write_edgetrain(config: LoraConfig, tensors: Tensors, path: Path, base: AdapterBase) -> Path:
    return write_lora_file(config, tensors, path)


def _mlx_adapters():
    try:
        from edgetrain.backends.mlx import adapters
    except ImportError as exc:
        raise AdapterError(f"mlx-lm adapters need mlx (pip install 'edgetrain[mlx]'): {exc}") from None
    return adapters


def _read_mlx_lm(path: Path, base: AdapterBase) -> tuple[LoraConfig, Tensors]:
    with tempfile.TemporaryDirectory() as tmp:
        file = _mlx_adapters().mlx_lm_to_torch_adapter(path, Path(tmp) / "adapter.safetensors")
        return read_lora_file(file)


def _write_mlx_lm(config: LoraConfig, tensors: Tensors, path: Path, base: AdapterBase) -> Path:
    # Made in a temp directory first, then written to `path` by mlx-lm's writer: its disk is checked before.
    check_free_space(path, tensor_bytes(tensors.values()), "the adapter")
    with tempfile.TemporaryDirectory() as tmp:
        file = write_lora_file(config, tensors, Path(tmp) / "adapter.safetensors")
        return _mlx_adapters().torch_adapter_to_mlx_lm(file, path)


def _read_peft(path: Path, base: AdapterBase) -> tuple[LoraConfig, Tensors]:
    from edgetrain.adapters.peft import read_peft_adapter

    config, tensors, _ = read_peft_adapter(path)
    return config, tensors


def _write_peft(config: LoraConfig, tensors: Tensors, path: Path, base: AdapterBase) -> Path:
    from edgetrain.adapters.peft import write_peft_adapter

    return write_peft_adapter(config, tensors, path, base.name)


def _read_gguf(path: Path, base: AdapterBase) -> tuple[LoraConfig, Tensors]:
    from edgetrain.adapters.gguf_lora import read_gguf_lora

    return read_gguf_lora(path, base.require_config(f"reading the GGUF adapter {path}"))


def _write_gguf(config: LoraConfig, tensors: Tensors, path: Path, base: AdapterBase) -> Path:
    from edgetrain.adapters.gguf_lora import write_gguf_lora

    return write_gguf_lora(config, tensors, path, base.require_config("writing a GGUF adapter"), base.name)


READERS: dict[str, Callable[[Path, AdapterBase], tuple[LoraConfig, Tensors]]] = {
    "edgetrain": _read_edgetrain, "peft": _read_peft, "mlx-lm": _read_mlx_lm, "gguf": _read_gguf}
WRITERS: dict[str, Callable[[LoraConfig, Tensors, Path, AdapterBase], Path]] = {
    "edgetrain": _write_edgetrain, "peft": _write_peft, "mlx-lm": _write_mlx_lm, "gguf": _write_gguf}


def read_adapter(path: str | Path, base: AdapterBase | None = None) -> tuple[LoraConfig, Tensors]:
    """(config, tensors under edgetrain's names) of an adapter in any of FORMATS (a GGUF adapter needs
    `base`; with a base config every format is checked to fit it)."""
    base = base or AdapterBase()
    config, tensors = READERS[detect_format(path)](Path(path), base)
    # Whatever the format, a tensor edgetrain cannot place is named here, before any is written or loaded.
    check_adapter_names(tensors, config, path)
    if base.config is not None:
        check_fits(config, tensors, base.config, path)
    return config, tensors


def check_fits(config: LoraConfig, tensors: Tensors, base: LlamaConfig, source: str | Path) -> None:
    """The adapter's tensors are exactly those of `config` on a `base` decoder, with its shapes, finite
    (what install_adapter checks against a live model, here from the config alone: the decoder is built
    on the meta device, so no weight memory is spent)."""
    from edgetrain.models.llama import LlamaModel
    from edgetrain.models.lora import add_lora, check_adapter_tensors, lora_state_dict
    from edgetrain.models.meta_build import meta_without_init

    with meta_without_init():  # torch.device("meta") alone runs the initialisers, importing torch._dynamo
        expected = lora_state_dict(add_lora(LlamaModel(base), config))
    check_adapter_tensors(tensors, expected, source)


def convert_adapter(source: str | Path, target: str | Path, target_format: str, base_model: str | None = None,
                    base_config: LlamaConfig | None = None) -> Path:
    """Write the adapter at `source` (any format) to `target` in `target_format`, atomically. `base_model`
    is recorded in the output where the format has a place for it; `base_config` (the base decoder's,
    e.g. from edgetrain.models.decoder_config) is needed for GGUF and checks that the adapter fits."""
    if target_format not in WRITERS:
        raise AdapterError(f"unknown adapter format {target_format!r}; known: {', '.join(FORMATS)}")
    if Path(source).resolve() == Path(target).resolve():
        raise AdapterError(f"{target}: the output would replace the adapter being read")
    base = AdapterBase(name=None if base_model is None else str(base_model), config=base_config)
    config, tensors = read_adapter(source, base)
    return WRITERS[target_format](config, tensors, Path(target), base)


def load_adapter(model: torch.nn.Module, path: str | Path) -> torch.nn.Module:
    """Load an adapter of any format into a torch model (all or nothing, as edgetrain.load_lora)."""
    from edgetrain.models.lora import install_adapter

    base_config = getattr(model, "config", None)
    base = AdapterBase(config=base_config if isinstance(base_config, LlamaConfig) else None)
    config, tensors = read_adapter(path, base)
    return install_adapter(model, config, tensors, path)


def load_adapter_into_mlx(model, path: str | Path):
    """An adapter of any format into an MLX model: mlx-lm directories load as they are, the others through
    an exact conversion to mlx-lm (the MLX backend's adapter loader)."""
    adapters = _mlx_adapters()
    if detect_format(path) == "mlx-lm":
        return adapters.load_mlx_lm_adapters(model, path)
    with tempfile.TemporaryDirectory() as tmp:
        base_config = getattr(model, "config", None)
        converted = convert_adapter(path, Path(tmp) / "adapter", "mlx-lm",
                                    base_config=base_config if isinstance(base_config, LlamaConfig) else None)
        return adapters.load_mlx_lm_adapters(model, converted)
