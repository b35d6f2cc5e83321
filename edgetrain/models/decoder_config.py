"""The hyper-parameters of a decoder named the way load_model names it, without loading its weights:
what adapter and merge exports need to know about a base model (its architecture, layers, heads)."""
from __future__ import annotations

from pathlib import Path

from edgetrain.models.llama import LlamaConfig
from edgetrain.registry import EdgetrainError


def decoder_config(name_or_path: str | Path) -> LlamaConfig:
    """The LlamaConfig of a decoder preset, pretrained name (fetched once), checkpoint directory or GGUF
    file; reads only metadata (config.json, the GGUF header), never the weights."""
    from edgetrain.models.decoder_presets import DECODER_PRESETS, preset_config
    from edgetrain.models.downloads import DOWNLOADS, fetch

    text = str(name_or_path)
    path = Path(name_or_path)
    if text in DOWNLOADS and not path.exists():
        path = fetch(text)
    if path.suffix.lower() == ".gguf":
        from edgetrain.models.gguf.config import config_from_metadata
        from edgetrain.models.gguf.reader import read_gguf

        return config_from_metadata(read_gguf(path))
    if path.is_dir():
        from edgetrain.models.decoders import config_from_hf_dict
        from edgetrain.models.hf_checkpoint import read_config

        return config_from_hf_dict(read_config(path), str(path / "config.json"))
    preset = preset_config(text)
    if preset is not None:
        return preset
    raise EdgetrainError(f"{text!r} is not a decoder: not a GGUF file, checkpoint directory, pretrained name "
                         f"or decoder preset ({', '.join(DECODER_PRESETS)})")
