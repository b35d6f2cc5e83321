"""`asyncfgd`: AsyncFGD (Accelerated On-Device Forward Neural Network Training with Module-Wise
Descending Asynchronism) as an edgetrain training method.

The model's block view is cut into K modules (`stages.py`); each `step(batch)` is one timestamp of
Algorithm 1 (`schedule.py`): the batch enters module 0 while module k works on the sample that
entered k steps earlier, and the sample entering K-1 steps earlier finishes and updates every module.
Runtimes: "threads" (K CPU threads, one intra-op thread each, pinned), "cuda-streams" (one CUDA
stream per module on one GPU), "reference" (one module after another in the caller's thread: the
deterministic oracle); "auto" picks cuda-streams for a CUDA model, threads for K > 1, else reference.
K = 1 is `fgd` exactly (same tangent keys, same code).

What the protocol methods return:
  step(batch)      -- the loss of the sample leaving the pipeline (it entered K-1 steps earlier),
                      computed with the weights its modules used. While the pipeline fills (the
                      first K-1 steps) no sample leaves; the loss of the entering batch at the
                      current weights is returned instead (one extra plain forward per fill step,
                      BatchNorm statistics left as they were), so a stream's first losses are real.
                      A leaving sample with a non-finite loss or derivative, or whose update would
                      write a non-finite weight or gradient estimate, updates nothing and raises
                      NonFiniteError, but the pipeline has advanced (the batch entered).
  gradients(batch) -- the forward-gradient estimate for `batch` at the current weights of every
                      module, i.e. without staleness, drawn with the tangents each module will use
                      for the next sample; weights and the pipeline are left as they were.

Resuming: state_dict() holds the seed, the step counter and the in-flight pipeline (each module's
output waiting for the next module: activation, JVPs, targets -- base64 in the JSON state, a few
activations' worth), so a resumed run continues exactly as the uninterrupted one. Tangents are not
state: they are drawn again from their keys (without tangent checkpointing the kept ones are drawn
again on load).

Options (Learner(method_options=...)), besides fgd's seed / alpha / num_tangents / tangent_checkpoint:
  num_modules       -- K (default 2)
  split             -- blocks per module, e.g. [3, 5]; default: as even as the block count allows
  runtime           -- "auto", "threads", "cuda-streams" or "reference"
  intra_op_threads  -- torch threads per worker (default 1)
  pin_workers       -- pin each CPU worker thread to its own core (default True)
"""
from __future__ import annotations

import base64
from typing import Any, Sequence

import torch
from torch import nn

from edgetrain.data.batch import Batch
from edgetrain.training.losses import task_loss
from edgetrain.methods.asyncfgd.schedule import InFlight, ReferenceScheduler, TimestampOutcome, non_finite_error
from edgetrain.methods.asyncfgd.stages import build_stages, describe_split
from edgetrain.methods.asyncfgd.workers import CudaStreamWorkers, ThreadWorkers
from edgetrain.methods.base import (METHODS, NonFiniteError, plain_sgd_learning_rates, require_finite,
                                    require_finite_gradients, trainable_parameters)
from edgetrain.methods.fgd import check_forward_gradient_options, make_tangent_bank
from edgetrain.methods.options import flag_option, positive_int_option
from edgetrain.methods.tangents import AlphaSpec, resolve_alpha
from edgetrain.registry import EdgetrainError

RUNTIMES = ("auto", "threads", "cuda-streams", "reference")


class AsyncFGD:
    name = "asyncfgd"
    # A failed step still moves the pipeline on (see `step` above), so the learner does not roll the
    # step's buffers and RNG back: in-flight samples ran their forwards.
    advances_on_failure = True

    def __init__(self, model: nn.Module, num_modules: int = 2, split: Sequence[int] | None = None,
                 runtime: str = "auto", seed: int = 0, alpha: AlphaSpec = 1.0, num_tangents: int = 1,
                 tangent_checkpoint: bool = True, intra_op_threads: int = 1, pin_workers: bool = True) -> None:
        self.seed, self.num_tangents = check_forward_gradient_options(self.name, seed, num_tangents)
        intra_op_threads = positive_int_option(self.name, "intra_op_threads", intra_op_threads)
        pin_workers = flag_option(self.name, "pin_workers", pin_workers)
        if runtime not in RUNTIMES:
            raise EdgetrainError(f"asyncfgd: unknown runtime {runtime!r}; known: {', '.join(RUNTIMES)}")
        self.model = model
        self.params = trainable_parameters(model)
        self.alpha_spec = alpha
        self.bank = make_tangent_bank(self.name, self.params, alpha, tangent_checkpoint)
        self.stages = build_stages(model, self.params, self.bank, self.seed, self.num_tangents, num_modules, split)
        self.num_modules = len(self.stages)
        self.device = next(iter(self.params.values())).device
        if runtime == "auto":
            runtime = ("cuda-streams" if self.device.type == "cuda" and self.num_modules > 1
                       else "threads" if self.num_modules > 1 else "reference")
        if runtime == "threads":
            self.runtime = ThreadWorkers(self.stages, intra_op_threads=intra_op_threads, pin=pin_workers)
        elif runtime == "cuda-streams":
            self.runtime = CudaStreamWorkers(self.stages, self.device, intra_op_threads=intra_op_threads)
        else:
            self.runtime = ReferenceScheduler(self.stages)
        self.steps_taken = 0  # the timestamp t of Algorithm 1
        self.in_flight: list[InFlight | None] = [None] * (self.num_modules - 1)

    # -- facts ---------------------------------------------------------------------------------
    @property
    def split(self) -> str:
        return describe_split(self.stages)

    @property
    def staleness(self) -> list[int]:
        """Updates by which module k's weights lag for the sample it updates with: K-1-k."""
        return [self.num_modules - 1 - k for k in range(self.num_modules)]

    def in_flight_tensors(self) -> list[torch.Tensor]:
        """Tensors the pipeline holds between steps (for memory accounting): in-flight activations,
        JVPs and targets, and the kept tangents when tangent checkpointing is off."""
        tensors = []
        for item in self.in_flight:
            if item is not None:
                tensors += [item.activation, item.targets, *[o for o in item.jvps if o is not None]]
        return tensors + self.bank.kept_tensors()

    def set_alpha(self, alpha: AlphaSpec) -> None:
        """Change the tangent scales from the next step on. A sample already in flight drew its
        tangents with the old scales; its update draws them with the new ones (the paper's ramp
        changes alpha once per epoch, so at most K-1 samples see the switch). Without tangent
        checkpointing the in-flight samples' tangents are kept as drawn, with the old scales, so a change
        while samples are in flight is refused: it would update them with other tangents than the
        documented ones (and a parameter unfrozen mid-flight would have no kept tangent at all)."""
        if not self.bank.checkpoint and any(item is not None for item in self.in_flight):
            raise EdgetrainError(f"{self.name}: set_alpha with samples in flight needs tangent_checkpoint=True "
                                 "(kept tangents carry the old scales); change alpha before the first step, "
                                 "or use tangent checkpointing")
        self.bank.alpha = resolve_alpha(alpha, self.params)
        self.alpha_spec = alpha

    # -- the protocol --------------------------------------------------------------------------
    def step(self, batch: Batch, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        t = self.steps_taken
        fill_loss = self._fill_loss(batch) if t < self.num_modules - 1 else None
        entering = InFlight(t, batch.inputs, [None] * self.num_tangents, batch.targets)
        learning_rates = plain_sgd_learning_rates(optimizer)
        try:
            outcome: TimestampOutcome = self.runtime.run([entering, *self.in_flight], learning_rates)
        except Exception:
            # Nothing advanced: module k drew its tangents this step for sample t - k, and the retry draws
            # them again under the same keys, so none may stay kept in between.
            for k, stage in enumerate(self.stages):
                if t - k >= 0:
                    stage.release(t - k)
            raise
        finished = outcome.finished
        self.in_flight = outcome.in_flight
        self.steps_taken = t + 1
        if finished is not None and (not finished.finite or outcome.refused is not None):
            for stage in self.stages:
                stage.release(finished.sample)
            if outcome.refused is not None:
                raise NonFiniteError(f"{outcome.refused}; the sample that entered at step {finished.sample} "
                                     "left the pipeline without updating any module")
            raise non_finite_error(finished)
        if finished is not None and learning_rates is None:
            require_finite_gradients(self.params, self.name)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return finished.loss if finished is not None else fill_loss

    @torch.no_grad()
    def _fill_loss(self, batch: Batch) -> torch.Tensor:
        buffers = [(b, b.clone()) for b in self.model.buffers()]
        loss = task_loss(self.model, self.model(batch.inputs), batch.targets)
        for buffer, kept in buffers:
            buffer.copy_(kept)
        return loss.detach()

    def gradients(self, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        sample = self.steps_taken
        h, jvps = batch.inputs, [None] * self.num_tangents
        try:
            for stage in self.stages:
                h, jvps = stage.forward(sample, h, jvps)
            loss, derivatives = self.stages[-1].loss_derivatives(h, jvps, batch.targets)
            require_finite(float(loss), "loss")
            for derivative in derivatives:
                require_finite(derivative, "directional derivative")
        except Exception:
            for stage in self.stages:
                stage.release(sample)
            raise
        estimate = {}
        for stage in self.stages:
            estimate.update(stage.estimate(sample, derivatives))
        return loss, {name: estimate.get(name, torch.zeros_like(p)) for name, p in self.params.items()}

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "steps_taken": self.steps_taken, "num_modules": self.num_modules,
                "num_tangents": self.num_tangents, "split": self.split, "alpha": self.alpha_spec,
                "in_flight": [None if item is None else _encode_in_flight(item) for item in self.in_flight]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("num_modules", "num_tangents", "split"):
            if state[key] != getattr(self, key):
                raise EdgetrainError(f"asyncfgd: checkpoint has {key}={state[key]!r}, this learner "
                                     f"{getattr(self, key)!r}; resume with the same pipeline")
        self.seed = int(state["seed"])
        for stage in self.stages:
            stage.seed = self.seed
        self.steps_taken = int(state["steps_taken"])
        # Not set_alpha: the pipeline is replaced below, its kept tangents drawn again at these scales.
        self.bank.alpha = resolve_alpha(state["alpha"], self.params)
        self.alpha_spec = state["alpha"]
        self.in_flight = [None if item is None else _decode_in_flight(item, self.device)
                          for item in state["in_flight"]]
        self.bank.clear()
        for k, item in enumerate(self.in_flight):
            if item is not None:  # modules 0..k drew tangents for this sample and have not updated yet
                for stage in self.stages[:k + 1]:
                    stage.refill_kept_tangents(item.sample)

    def close(self) -> None:
        """Stop the worker threads (also done when the method is garbage-collected)."""
        self.runtime.close()


def _encode_tensor(tensor: torch.Tensor | None) -> dict[str, Any] | None:
    if tensor is None:
        return None
    data = tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
    return {"dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape),
            "data": base64.b64encode(data).decode("ascii")}


def _decode_tensor(record: dict[str, Any] | None, device: torch.device) -> torch.Tensor | None:
    if record is None:
        return None
    raw = torch.frombuffer(bytearray(base64.b64decode(record["data"])), dtype=torch.uint8)
    return raw.view(getattr(torch, record["dtype"])).reshape(record["shape"]).to(device)


def _encode_in_flight(item: InFlight) -> dict[str, Any]:
    return {"sample": item.sample, "activation": _encode_tensor(item.activation),
            "jvps": [_encode_tensor(o) for o in item.jvps], "targets": _encode_tensor(item.targets)}


def _decode_in_flight(record: dict[str, Any], device: torch.device) -> InFlight:
    return InFlight(int(record["sample"]), _decode_tensor(record["activation"], device),
                    [_decode_tensor(o, device) for o in record["jvps"]], _decode_tensor(record["targets"], device))


METHODS.add("asyncfgd", AsyncFGD)
