"""edgetrain: train and fine-tune neural networks on the device (MLX, CUDA/Jetson, CPU).

The public names below are imported on first use (PEP 562), so that `import edgetrain.cli` and
`edgetrain --help` or `--version` answer without importing torch.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from edgetrain.registry import EdgetrainError
from edgetrain.utils.lazy import lazy_exports

__version__ = "0.1.0"

# public name -> the module that defines it
_LAZY = {
    "MODEL_PRESETS": "edgetrain.models", "load_model": "edgetrain.models",
    "LoadOptions": "edgetrain.backends.load_options",
    "LoraConfig": "edgetrain.models.lora", "add_lora": "edgetrain.adapters.portable",
    "load_lora": "edgetrain.models.lora", "merge_lora": "edgetrain.models.lora", "save_lora": "edgetrain.adapters.portable",
    "unmerge_lora": "edgetrain.models.lora",
    "Learner": "edgetrain.training.learner", "StepStats": "edgetrain.training.stats",
    "generate": "edgetrain.models.generate", "held_out_loss": "edgetrain.models.generate",
    "Personaliser": "edgetrain.personalise",
}

if TYPE_CHECKING:
    from edgetrain.training.learner import Learner
    from edgetrain.training.stats import StepStats
    from edgetrain.models import MODEL_PRESETS, load_model
    from edgetrain.backends.load_options import LoadOptions
    from edgetrain.models.generate import generate, held_out_loss
    from edgetrain.adapters.portable import add_lora, save_lora
    from edgetrain.models.lora import LoraConfig, load_lora, merge_lora, unmerge_lora
    from edgetrain.personalise import Personaliser


# `import edgetrain` then `edgetrain.data.digits_stream(...)`: subpackages load on first use too.
__getattr__ = lazy_exports(__name__, _LAZY, globals(), submodules=True)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = ["EdgetrainError", "Learner", "StepStats", "LoadOptions", "LoraConfig", "MODEL_PRESETS", "Personaliser", "add_lora",
           "generate", "held_out_loss", "load_lora", "load_model", "merge_lora", "save_lora", "unmerge_lora", "__version__"]
