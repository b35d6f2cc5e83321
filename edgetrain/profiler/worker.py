"""Profile one (method, config) in this process. Run as `python -m edgetrain.profiler.worker JSON`
by the runner, one fresh process per method so one method's cached memory cannot pollute another's.

Order matters: gradient fidelity first (on the untouched weights, so every method sees the same
weights and batch and reports the same loss; against bp on a float64 copy of the model), then a warm-up
step, then timed steps read by the OS/allocator probe, then one step whose matrix products are recorded
for the compute floor (edgetrain/profiler/compute_floor.py), then one step with every operator timed
(edgetrain/profiler/step_breakdown.py), then one step under tensor accounting (all slow ops, so they are never
timed).
"""
from __future__ import annotations

import json
import statistics
import sys
import traceback
from typing import Any

from edgetrain.profiler.batches import build_batch

RESULT_MARKER = "EDGETRAIN_RESULT "


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def build_model(config):
    import torch

    import edgetrain

    torch.manual_seed(config.seed)
    model = edgetrain.load_model(config.model, backend=config.backend, options=config.load_options())
    if config.layers is not None:
        if not 0 < config.layers <= len(model.blocks):
            raise edgetrain.EdgetrainError(f"--layers {config.layers}: the model has {len(model.blocks)} blocks")
        del model.blocks[config.layers:]
    if getattr(model, "task", None) == "lm":
        edgetrain.add_lora(model, rank=config.rank)
        # A fresh LoRA B is zero, which would make every A gradient zero and fidelity meaningless.
        generator = torch.Generator().manual_seed(config.seed + 1)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("lora_B"):
                    param.copy_(torch.randn(param.shape, generator=generator).to(param.dtype) * 0.01)
    return model


# What every method's gradient is compared with (the record's "grad_reference").
GRADIENT_REFERENCE = "bp in float64"


def gradient_fidelity(model, method: str, batch, options: dict[str, Any]) -> dict[str, Any]:
    """Loss, and cosine / max relative error of the method's gradient against the fp64 reference: exact
    autograd (bp) on a float64 copy of the model, on the same batch and weights.

    Not fp32 bp: fp32 autograd is itself off the exact gradient -- its full-vocabulary fp32 cross-entropy
    is the least exact of the methods on SmolLM2-135M (fp32 mesp within 1.1e-5 of fp64, fp32 bp further)
    --, so an fp32 reference blamed the more exact method for bp's error. Against fp64, every method's
    error is its own, bp's included. The copy normalises and takes the loss in fp64 too
    (edgetrain.training.precision), so it is an fp64 computation throughout."""
    import copy

    import torch

    from edgetrain.methods import METHODS

    batch = batch.to(next(model.parameters()).device)  # the model may sit on a GPU; build_batch is on the CPU
    reference_model = copy.deepcopy(model).double()
    reference_loss, reference = METHODS.get("bp")(reference_model).gradients(batch)
    del reference_model  # freed before the method runs: the fidelity pass is not what is measured
    loss, estimate = METHODS.get(method)(model, **options).gradients(batch)
    flat_ref = torch.cat([reference[k].flatten() for k in reference])
    flat_est = torch.cat([estimate[k].flatten().double() for k in reference])
    cosine = float(torch.nn.functional.cosine_similarity(flat_est, flat_ref, dim=0))
    max_rel = max(float((estimate[k].double() - reference[k]).abs().max()
                        / reference[k].abs().max().clamp_min(1e-30)) for k in reference)
    return {"loss": float(loss), "reference_loss": float(reference_loss), "grad_cosine": cosine,
            "grad_max_rel_err": max_rel, "grad_reference": GRADIENT_REFERENCE}


def profile_method(config) -> dict[str, Any]:
    """Profile one method as config says, with the profiler of config.backend's framework."""
    from edgetrain.backends import get_backend

    return get_backend(config.backend).profile_method(config)


def profile_torch_method(config) -> dict[str, Any]:
    import torch

    import edgetrain
    from edgetrain.models.quantized import packed_matrix_count
    from edgetrain.probes import TensorAccountant, default_probe_name, measuring
    from edgetrain.training.threads import thread_fitter

    runtime_baseline = _runtime_baseline_bytes(default_probe_name(config.backend))
    _progress(f"[{config.method}] building {config.model} ({config.dtype})")
    model = build_model(config)
    batch = build_batch(model, config)
    record: dict[str, Any] = {"method": config.method, "backend": config.backend, "model": config.model,
                              "seq": config.seq, "batch": config.batch, "rank": config.rank,
                              "dtype": config.dtype, "layers": len(model.blocks),
                              "lora": getattr(model, "lora_config", None) is not None,
                              "quantize_bits": config.quantize_bits, "dequantize": config.dequantize,
                              "base": config.load_options().describe(), "packed_matrices": packed_matrix_count(model)}
    # One fitter for the whole worker: the fidelity pass and the untimed steps run beside the same load as the
    # timed ones (fixed at every core beside a busy one, an fp64 reference step thrashed for minutes).
    threads = thread_fitter(config.threads)
    _apply_threads(threads)
    if config.fidelity:
        _progress(f"[{config.method}] gradient fidelity against {GRADIENT_REFERENCE}")
        record.update(gradient_fidelity(model, config.method, batch, config.method_options))
    else:
        record.update({"loss": None, "grad_cosine": None, "grad_max_rel_err": None, "grad_reference": None})

    probe_name = default_probe_name(config.backend)
    learner = edgetrain.Learner(model, method=config.method, backend=config.backend, optimizer="sgd",
                                lr=1e-5, method_options=config.method_options, probe=probe_name,
                                seed=config.seed, threads=threads)
    _progress(f"[{config.method}] warm-up step" + ("s" if config.warmup > 1 else ""))
    first = learner.step(batch)
    for _ in range(config.warmup - 1):
        learner.step(batch)
    # Read as a step's own baseline is read (edgetrain.training.step_memory): after the allocator's free memory
    # went back to the kernel, so that free heap is not counted here and again in the step's peak.
    from edgetrain.training.step_memory import release_before_step

    release_before_step()
    resident_before_steps = _resident_bytes(learner.probe) if learner.probe is not None else None
    if record["loss"] is None:
        record["loss"] = first.loss
    seconds, peaks = [], []
    load_before = _cpu_reading()
    faults_before = _minor_faults()
    for index in range(config.steps):
        _progress(f"[{config.method}] step {index + 1}/{config.steps}")
        stats = learner.step(batch)
        seconds.append(stats.seconds)
        peaks.append(stats.peak_bytes)
    faults_after = _minor_faults()
    # Pages the kernel had to map in and zero for the steps: each fresh temporary's, with the probe's pinned
    # mmap threshold (edgetrain/methods/mesp/step_buffers.py says what that cost mesp).
    record["minor_faults_per_step"] = (None if faults_before is None or faults_after is None
                                       else round((faults_after - faults_before) / config.steps))
    record["others_busy_cores"] = _others_busy(load_before)
    record["threads_choice"] = config.threads  # None: torch's own count; "auto": fitted between steps
    record["probe"] = stats.probe
    record["step_seconds"] = statistics.median(seconds)
    record["peak_bytes_probe"] = None if any(p is None for p in peaks) else max(peaks)
    # The whole footprint: what the process holds above the framework's own runtime (weights, their
    # quantisation, buffers) plus the step's peak above that.
    record["footprint_bytes"] = None if None in (resident_before_steps, runtime_baseline,
                                                 record["peak_bytes_probe"]) else \
        resident_before_steps - runtime_baseline + record["peak_bytes_probe"]
    record["runtime_baseline_bytes"] = runtime_baseline
    from edgetrain.training.step_estimates import estimate_step_bytes

    record["estimate_bytes"] = estimate_step_bytes(model, batch, config.method, config.method_options)

    _progress(f"[{config.method}] compute floor (the step's matrix products, each timed alone)")
    from edgetrain.profiler.compute_floor import measure_compute_floor

    record.update(measure_compute_floor(lambda: learner.step(batch), record["step_seconds"]))
    from edgetrain.profiler.step_breakdown import measure_step_breakdown, times_operators_on

    if times_operators_on(batch.inputs.device):
        _progress(f"[{config.method}] step breakdown (every operator and tile timed)")
        record.update(measure_step_breakdown(lambda: learner.step(batch), record["step_seconds"],
                                             record["floor_seconds"]))

    _progress(f"[{config.method}] tensor accounting step")
    accountant = TensorAccountant(model=model)
    accountant.register(learner.optimizer, batch.inputs, batch.targets)
    with measuring(accountant) as measured:
        learner.step(batch)
    record["peak_bytes_tensors"] = measured.peak_above_baseline_bytes
    record["peak_region"] = accountant.report().peak_label
    record["trainable_params"] = sum(p.numel() for p in learner.params.values())
    record["weights_bytes"] = sum(t.numel() * t.element_size()
                                  for t in list(model.parameters()) + list(model.buffers()))
    record["torch_threads"] = torch.get_num_threads()
    return record


def _apply_threads(threads) -> None:
    """Set torch's intra-op threads as the learner will (a fixed count, or the fitter's choice now)."""
    if threads is None:
        return
    import torch

    from edgetrain.training.threads import thread_count

    torch.set_num_threads(thread_count(threads))


def _minor_faults() -> int | None:
    """This process's minor page faults so far (None where getrusage is missing: Windows)."""
    try:
        import resource
    except ImportError:
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _cpu_reading():
    from edgetrain.training.threads import read_cpu

    try:
        return read_cpu()
    except Exception:  # noqa: BLE001 -- psutil missing or refused here: the load is then not reported
        return None


def _others_busy(before) -> float | None:
    """Cores' worth of CPU other processes used while the steps were timed (None where it cannot be read)."""
    from edgetrain.training.threads import others_busy_cores

    after = _cpu_reading()
    return None if before is None or after is None else round(others_busy_cores(before, after), 2)


def _runtime_baseline_bytes(probe_name: str) -> int | None:
    """What this process holds with torch's runtime loaded and nothing built (about 290 MiB on Linux): torch,
    edgetrain's training code, and torch._dynamo (about 70 MiB of Python objects), which torch.optim and
    torch.utils.checkpoint (mebp) import on first use and edgetrain's own optimizers do not. The footprint is
    counted from here, so methods compare on their steps alone, not on which of torch's modules they touch."""
    import torch

    import edgetrain.training.learner  # noqa: F401
    import edgetrain.training.step_estimates  # noqa: F401
    from edgetrain.probes import PROBES

    torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    from edgetrain.training.step_memory import release_before_step

    probe = PROBES.get(probe_name)()
    release_before_step()
    return _resident_bytes(probe) if probe.available()[0] else None


def _resident_bytes(probe) -> int:
    """What the probe reads now, less file-backed pages where it can tell them apart: library code the
    first kernels map in (tens of MiB) is shared and the kernel's to drop, not the training's footprint."""
    from edgetrain.training.step_memory import file_backed_bytes

    file_bytes = file_backed_bytes(probe)
    return probe.current_bytes() - (file_bytes or 0)


def main(argv: list[str] | None = None) -> int:
    from edgetrain.profiler.config import ProfileConfig

    argv = sys.argv[1:] if argv is None else argv
    try:
        config = ProfileConfig(**json.loads(argv[0]))
        from edgetrain.probes.glibc import fix_malloc_mmap_threshold

        fix_malloc_mmap_threshold()
        record = profile_method(config)
    except Exception as exc:  # reported to the parent, which prints it with the method's name
        from edgetrain.registry import EdgetrainError

        detail = str(exc) if isinstance(exc, EdgetrainError) else traceback.format_exc()
        print(RESULT_MARKER + json.dumps({"error": f"{type(exc).__name__}: {detail}"}), flush=True)
        return 1
    print(RESULT_MARKER + json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
