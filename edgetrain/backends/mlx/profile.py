"""Profile one MLX method in this process: the MLX twin of edgetrain.profiler.worker.profile_method,
with the same record fields.

Memory figures (each the peak above the pre-step baseline, max over the timed steps):
  peak_bytes_probe    the backend's default probe, "mlx": mx.get_peak_memory after
                      mx.reset_peak_memory -- what MLX's allocator handed out (Metal buffers, or host
                      memory with mlx[cpu]), its buffer cache excluded.
  peak_bytes_tensors  the same MLX figure: MLX's active memory is exactly its live arrays, so it is
                      the tensor accounting the torch worker does with TensorAccountant.
  peak_bytes_os       the OS probe (phys_footprint on macOS, RSS on Linux), None where unavailable.
"""
from __future__ import annotations

import os
import statistics
import sys
from typing import Any

import mlx.core as mx
import numpy as np

from edgetrain.backends.mlx.engine import batch_arrays
from edgetrain.backends.mlx.loading import load_mlx_model
from edgetrain.backends.mlx.lora import add_lora, set_parameters, trainable_parameters
from edgetrain.backends.mlx.methods import MLX_METHODS
from edgetrain.backends.mlx.quantize import packed_matrix_count
from edgetrain.backends.load_options import LoadOptions
from edgetrain.training.learner import Learner


def blas_in_use() -> str:
    """Which BLAS MLX's CPU matmuls run on in this process (they set CPU step times).

    libmlx looks cblas_sgemm up in the global scope (LD_PRELOAD first) before its own bundled
    reference BLAS, so whichever library the global lookup finds is the one that runs."""
    if sys.platform == "darwin":
        return "Accelerate" + (" (matmuls on the Metal GPU)" if mx.metal.is_available() else "")
    if not sys.platform.startswith("linux"):
        return "unknown"
    import ctypes

    class DlInfo(ctypes.Structure):
        _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                    ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]

    try:
        process = ctypes.CDLL(None)
        address = ctypes.cast(process.cblas_sgemm, ctypes.c_void_p)
    except (OSError, AttributeError):
        return "reference BLAS bundled with mlx[cpu] (slow: LD_PRELOAD an OpenBLAS for CPU timings)"
    info = DlInfo()
    process.dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(DlInfo)]
    if not process.dladdr(address, ctypes.byref(info)) or not info.dli_fname:
        return "unknown"
    path = info.dli_fname.decode(errors="replace")
    if "openblas" in path.lower():
        return f"OpenBLAS ({path}; OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'unset')})"
    return path


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def build_model(config: Any, quantize_bits: int | None = None):
    model = load_mlx_model(config.model, dtype=config.dtype, seed=config.seed, layers=config.layers,
                           quantize_bits=quantize_bits, dequantize=getattr(config, "dequantize", False))
    add_lora(model, rank=config.rank)
    # A fresh lora_b is zero, which would make every lora_a gradient zero and fidelity meaningless.
    keys = mx.random.split(mx.random.key(config.seed + 1), len(trainable_parameters(model)))
    params = trainable_parameters(model)
    set_parameters(model, {name: (mx.random.normal(p.shape, key=keys[i]) * 0.01).astype(p.dtype)
                           for i, (name, p) in enumerate(params.items()) if name.endswith("lora_b")})
    mx.eval(model.trainable_parameters())
    return model


def gradient_fidelity(model, method: str, inputs: mx.array, targets: mx.array,
                      options: dict[str, Any]) -> dict[str, float]:
    """Loss, and cosine / max relative error of the method's gradient against exact autodiff."""
    reference_loss, reference = MLX_METHODS.get("bp")(model).gradients(inputs, targets)
    loss, estimate = MLX_METHODS.get(method)(model, **options).gradients(inputs, targets)
    flat_ref = np.concatenate([np.array(reference[k], dtype=np.float64).ravel() for k in reference])
    flat_est = np.concatenate([np.array(estimate[k], dtype=np.float64).ravel() for k in reference])
    cosine = float(flat_est @ flat_ref / max(np.linalg.norm(flat_est) * np.linalg.norm(flat_ref), 1e-300))
    max_rel = max(float(np.abs(np.array(estimate[k], dtype=np.float64) - np.array(reference[k], dtype=np.float64)).max()
                        / max(float(np.abs(np.array(reference[k], dtype=np.float64)).max()), 1e-30)) for k in reference)
    return {"loss": float(loss), "reference_loss": float(reference_loss), "grad_cosine": cosine,
            "grad_max_rel_err": max_rel}


def _os_probe():
    from edgetrain.probes import PROBES, default_probe_name

    probe = PROBES.get(default_probe_name("torch-cpu"))()
    return probe if probe.available()[0] else None


def profile_method_mlx(config: Any, quantize_bits: int | None = None) -> dict[str, Any]:
    """Profile config.method on config.model with the MLX backend (config: a ProfileConfig; its
    `quantize_bits`, when it has one, wins over the argument: 4 = the paper's 4-bit base)."""
    from edgetrain.profiler.batches import build_batch

    if getattr(config, "quantize_bits", None) is not None:
        quantize_bits = config.quantize_bits
    _progress(f"[{config.method}] building {config.model} ({config.dtype}, MLX"
              f"{f', {quantize_bits}-bit base' if quantize_bits else ''})")
    model = build_model(config, quantize_bits)
    batch = build_batch(model, config)
    inputs, targets = batch_arrays(batch)
    record: dict[str, Any] = {"method": config.method, "backend": "mlx", "model": config.model,
                              "seq": config.seq, "batch": config.batch, "rank": config.rank,
                              "dtype": config.dtype, "layers": len(model.blocks), "lora": True,
                              "quantize_bits": quantize_bits, "dequantize": getattr(config, "dequantize", False),
                              "base": LoadOptions(dequantize=getattr(config, "dequantize", False),
                                                  quantize_bits=quantize_bits, dtype=config.dtype).describe(),
                              "packed_matrices": packed_matrix_count(model),
                              "mlx_device": str(mx.default_device()),
                              "blas": blas_in_use()}
    if config.fidelity:
        _progress(f"[{config.method}] gradient fidelity against autodiff")
        record.update(gradient_fidelity(model, config.method, inputs, targets, config.method_options))
    else:
        record.update({"loss": None, "grad_cosine": None, "grad_max_rel_err": None})
    mx.clear_cache()

    learner = Learner(model, method=config.method, backend="mlx", optimizer="sgd", lr=1e-5,
                         method_options=config.method_options, probe="mlx", seed=config.seed)
    os_probe = _os_probe()
    _progress(f"[{config.method}] warm-up step")
    first = learner.step(batch)
    if record["loss"] is None:
        record["loss"] = first.loss
    seconds, peaks, os_peaks = [], [], []
    for index in range(config.steps):
        _progress(f"[{config.method}] step {index + 1}/{config.steps}")
        mx.clear_cache()
        os_baseline = None
        if os_probe is not None:
            os_probe.reset_peak()
            os_baseline = os_probe.current_bytes()
        stats = learner.step(batch)
        if os_probe is not None:
            os_peaks.append(max(0, os_probe.peak_bytes() - os_baseline))
        seconds.append(stats.seconds)
        peaks.append(stats.peak_bytes)
    record["probe"] = stats.probe
    record["step_seconds"] = statistics.median(seconds)
    record["peak_bytes_probe"] = None if any(p is None for p in peaks) else max(peaks)
    record["peak_bytes_tensors"] = record["peak_bytes_probe"]
    record["peak_region"] = "mlx allocator (live arrays)"
    record["os_probe"] = None if os_probe is None else os_probe.name
    record["peak_bytes_os"] = max(os_peaks) if os_peaks else None
    record["trainable_params"] = sum(int(p.size) for p in trainable_parameters(model).values())
    record["weights_bytes"] = learner.weights_bytes
    record["torch_threads"] = None
    return record
