"""Registers backend "mlx": MLX on the Apple GPU when Metal is there, else on the CPU (mlx[cpu]).

Importing this module never imports mlx (edgetrain.backends imports it on every `import edgetrain`):
availability() says why not when mlx is missing, and the device is read from the platform.
"""
from __future__ import annotations

import platform
import sys

from edgetrain.backends.base import BACKENDS, Backend


def mlx_availability() -> tuple[bool, str]:
    try:
        import mlx.core  # noqa: F401
    except ImportError as exc:
        return False, f"mlx is not importable ({exc}); install edgetrain[mlx]"
    return True, ""


def mlx_device() -> str:
    """"gpu" where MLX has Metal (Apple silicon), else "cpu"; "none" without mlx."""
    try:
        import mlx.core as mx
    except ImportError:
        return "none"
    return "gpu" if mx.metal.is_available() else "cpu"


def expected_device() -> str:
    """mlx_device() without importing mlx: MLX has Metal on Apple silicon Macs, else runs on the CPU."""
    return "gpu" if sys.platform == "darwin" and platform.machine() == "arm64" else "cpu"


def synchronize() -> None:
    import mlx.core as mx

    mx.synchronize()


if "mlx" not in BACKENDS:
    BACKENDS.add("mlx", Backend(
        name="mlx", framework="mlx", device=expected_device(), synchronize=synchronize,
        availability=mlx_availability, probe=lambda: "mlx",
        engine="edgetrain.backends.mlx.engine:MLXEngine",
        loader="edgetrain.backends.mlx.loading:load_mlx_for_backend",
        methods="edgetrain.backends.mlx.methods:MLX_METHODS",
        profiler="edgetrain.backends.mlx.profile:profile_method_mlx",
        add_lora="edgetrain.backends.mlx.lora:add_lora",
        save_adapter="edgetrain.backends.mlx.adapters:save_mlx_lm_adapters",  # an mlx-lm adapter directory
        adapter_loader="edgetrain.adapters.convert:load_adapter_into_mlx",
        adapter_is_directory=True, quantized_base=True, quantizer="edgetrain.backends.mlx.quantize:quantize_model",
        packed_gguf_loader="edgetrain.backends.mlx.loading:load_packed_gguf_mlx", loader_quantizes=True,
        loads_gguf=True,  # Q4_0 / Q4_1 / Q8_0 projections kept quantised by default (edgetrain.backends.mlx.gguf)
        reads_text_out=True, text_out="edgetrain.backends.mlx.generate"))
