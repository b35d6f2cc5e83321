"""MLX training methods by name (MLX_METHODS): bp, mebp, mezo, mesp. Importing registers them."""
from edgetrain.backends.mlx.methods import autodiff, mesp, mezo  # noqa: F401
from edgetrain.backends.mlx.methods.common import MLX_METHODS, MLXMethod, lm_loss

__all__ = ["MLX_METHODS", "MLXMethod", "lm_loss"]
