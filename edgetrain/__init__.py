"""edgetrain: train and fine-tune neural networks on the device (MLX, CUDA/Jetson, CPU)."""
from __future__ import annotations

from edgetrain.models import MODEL_PRESETS, load_model
from edgetrain.models.lora import LoraConfig, add_lora, load_lora, merge_lora, save_lora, unmerge_lora
from edgetrain.learner import Learner, StepStats
from edgetrain.registry import EdgetrainError

__version__ = "0.1.0"

__all__ = ["EdgetrainError", "Learner", "StepStats", "LoraConfig", "MODEL_PRESETS", "add_lora", "load_lora", "load_model",
           "merge_lora", "save_lora", "unmerge_lora", "__version__"]
