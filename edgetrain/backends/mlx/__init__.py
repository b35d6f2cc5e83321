"""The MLX backend: MLX versions of the Llama/Qwen2 decoder and LoRA, the bp / mebp / mezo / mesp
methods (run by edgetrain.Learner with backend="mlx"), and mlx-lm-format adapters.

Importing this package registers the "mlx" backend and never imports mlx itself (its availability
says why when mlx is missing); the submodules need mlx:

    from edgetrain.backends.mlx.loading import load_mlx_model
    from edgetrain.backends.mlx.lora import add_lora
    edgetrain.Learner(model, backend="mlx", ...)
"""
from edgetrain.backends.mlx.register import mlx_availability, mlx_device, synchronize

__all__ = ["mlx_availability", "mlx_device", "synchronize"]
