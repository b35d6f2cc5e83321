"""The stage-by-stage trainer behind `segprop` and `lw`: one object that is both a TrainingMethod (one
step of the current stage per `step(batch, optimizer)`) and the keeper of the schedule.

What a stage does to the model (SegProp Algorithm 1):
  * committed units (everything before the stage's first unit, the embedding included) get
    requires_grad=False, are put in eval() and *pinned* there: a later model.train() (Learner.evaluate
    calls it) leaves them in eval, so their BatchNorm statistics never move again; their forward runs
    under no_grad, its output detached (or comes from SnapCheck);
  * the active units, the stage's adapter (segprop) or auxiliary classifier (lw), the global-head units
    and the head train; units after the stage are off the loss path and frozen;
  * optimizer state of every parameter that stops training is freed at the stage change.
Adapters live in `model.stage_adapters` while training, so the learner's optimizer and checkpoints
cover them; `finish()` deletes them, unpins everything and restores requires_grad: what is left is
the plain model, whose forward is the assembled blocks.

Only parameters that were trainable when the method was built ever train (LoRA: the adapters inside
the active segment and the head; the base weights stay frozen).
"""
from __future__ import annotations

import math
from functools import partial
from typing import Any, Callable, Hashable, Iterable, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as activation_checkpoint

from edgetrain.data.batch import Batch
from edgetrain.logs import get_logger
from edgetrain.losses import task_loss
from edgetrain.methods.base import NonFiniteError, require_finite
from edgetrain.methods.segprop.adapters import AuxiliaryClassifier, make_adapter, model_norm_groups
from edgetrain.methods.segprop.plan import Stage, StagePlan, plan_lw, plan_segprop
from edgetrain.methods.segprop.snapcheck import SnapCheck, input_fingerprint
from edgetrain.methods.segprop.views import UnitView, probe_activation_bytes, probe_specs, unit_view
from edgetrain.registry import EdgetrainError

log = get_logger(__name__)
ADAPTERS_ATTRIBUTE = "stage_adapters"
LR_SCHEDULES = ("constant", "cosine")
BALANCES = ("blocks", "memory")


# -- keeping committed modules in eval() -------------------------------------------------------------

def _stay_in_eval(module: nn.Module, mode: bool = True) -> nn.Module:
    return nn.Module.train(module, False)


def pin_eval(module: nn.Module) -> None:
    """Put `module` and its submodules in eval() so that no later train() call takes them out.
    Each submodule gets an instance-level `train` (the class is untouched); unpin_eval removes it."""
    for sub in module.modules():
        sub.train = partial(_stay_in_eval, sub)
    nn.Module.train(module, False)


def unpin_eval(module: nn.Module) -> None:
    for sub in module.modules():
        sub.__dict__.pop("train", None)


def is_pinned(module: nn.Module) -> bool:
    return "train" in module.__dict__


# -- learning-rate multipliers -------------------------------------------------------------------------

def cosine_multiplier(step: int, total: int, warmup: int, floor: float) -> float:
    """SegProp's Eq. F.1 as a multiplier of the peak rate: linear warm-up over `warmup` steps, then
    cosine from 1 down to `floor` at step `total` (and `floor` after it)."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if total <= warmup:  # no room for a cosine: here step >= warmup >= total, past the end
        return floor
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + 0.5 * (1.0 - floor) * (1.0 + math.cos(math.pi * progress))


# -- the trainable path of one stage ---------------------------------------------------------------

class ActivePath(nn.Module):
    """What runs with autograd in one stage: [embed] -> active units -> bridge -> head units -> head.
    Its own module so that a distributed wrapper (DistributedDataParallel) can take exactly it."""

    def __init__(self, embed: nn.Module | None, units: Sequence[nn.Module], bridge: nn.Module | None,
                 tail: Sequence[nn.Module], head: nn.Module | None, checkpointed: bool) -> None:
        super().__init__()
        self.embed = embed
        self.units = nn.ModuleList(units)
        self.bridge = bridge
        self.tail = nn.ModuleList(tail)
        self.head = head
        self.checkpointed = checkpointed

    def _unit(self, unit: nn.Module, h: Any) -> Any:
        if self.checkpointed:
            # Non-reentrant: also right when the unit's input needs no grad (a detached frozen prefix).
            return activation_checkpoint(unit, h, use_reentrant=False)
        return unit(h)

    def forward(self, h: Any) -> Any:
        if self.embed is not None:
            h = self.embed(h)
        for unit in self.units:
            h = self._unit(unit, h)
        if self.bridge is not None:
            h = self.bridge(h)
        for unit in self.tail:
            h = self._unit(unit, h)
        return self.head(h) if self.head is not None else h


def _module_params(modules: Iterable[nn.Module | None]) -> list[nn.Parameter]:
    seen: dict[int, nn.Parameter] = {}
    for module in modules:
        if module is not None:
            for param in module.parameters():
                seen.setdefault(id(param), param)
    return list(seen.values())


def _unique(params: list[nn.Parameter]) -> list[nn.Parameter]:
    return list({id(p): p for p in params}.values())


def _parse_optional_bytes(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0:
        return 0
    from edgetrain.memory_sizes import parse_bytes

    return parse_bytes(value)


class StagedTrainer:
    """A staged schedule (segprop or lw) over a model's units; see the module docstring.

    Options, all JSON values (Learner(method_options=...)):
      view            "auto"/"blocks" (the block view) or "resnet-paper" (views.py)
      head_blocks     r, units in the global head (segprop; default 1); for lw they join the last segment
      segments / split / prefix   how the body is cut (plan.py); default 2 equal segments
      balance         "blocks": `segments` of equal unit counts (the paper's); "memory": of balanced
                      activation memory (bytes each unit saves for backward, measured once on the
                      example input), which lowers the peak of the heaviest stage
      steps_per_stage a number, or one per stage: the stage ends after that many steps (the
                      schedule's length; None = only advance_stage() or a plateau ends a stage)
      plateau_window, plateau_patience, plateau_min_delta
                      also end a stage when the mean training loss of `plateau_window` steps has not
                      improved by a relative `plateau_min_delta` for `plateau_patience` windows
      lr_schedule     "constant" or "cosine": each stage's own units (and adapter) follow a cosine
                      with `warmup_steps` over the stage's steps_per_stage, starting fresh each stage;
                      the global head follows one cosine over the whole schedule (paper appendix F);
                      rates are the optimizer's lr times the multiplier (floor `min_lr_ratio`), the
                      head's also times `head_lr_scale`
      checkpoint      activation checkpointing of every active unit and head unit
      snapcheck       cache frozen-prefix outputs (snapcheck.py): `snapcheck_budget` in memory (None =
                      no limit), spilled to `snapcheck_spill` ("auto" = a temporary directory, None =
                      drop) up to `snapcheck_disk_budget`; batch id = batch.index, or batch.index % snapcheck_period
                      for a stream whose order repeats every snapcheck_period batches
      adapter         "auto", "conv", "linear" or "identity" (adapters.py)
      aux_head        lw's local classifiers: "auto", "linear" (GAP + Linear, the paper's) or "copy"
    Python-only: `adapters={stage index: module}` overrides built adapters, `example_input` is the
    input used once to read the shapes between units (default: edgetrain.models.zoo.example_input).
    """

    partial_updates = False

    def __init__(self, name: str, model: nn.Module, *, view: str = "auto", head_blocks: int | None = None,
                 segments: int | None = None, split: Sequence[int] | None = None, prefix: int | None = None,
                 balance: str = "blocks",
                 steps_per_stage: int | Sequence[int] | None = None, plateau_window: int = 0,
                 plateau_patience: int = 0, plateau_min_delta: float = 1e-3, lr_schedule: str = "constant",
                 warmup_steps: int = 0, min_lr_ratio: float = 0.0, head_lr_scale: float = 1.0,
                 checkpoint: bool = False, snapcheck: bool = False, snapcheck_budget: Any = "256MiB",
                 snapcheck_spill: str | None = "auto", snapcheck_disk_budget: Any = "2GiB",
                 snapcheck_period: int | None = None, adapter: str = "auto", aux_head: str = "auto",
                 adapters: dict[int, nn.Module] | None = None, example_input: Any = None) -> None:
        self.name = name
        self.model = model
        if hasattr(model, ADAPTERS_ATTRIBUTE):
            raise EdgetrainError(f"{name}: the model already carries model.{ADAPTERS_ATTRIBUTE} (another staged "
                                 "method is attached; call its finish() first)")
        self.view: UnitView = unit_view(model, view)
        n = len(self.view)
        device, dtype = self._device_dtype()
        if example_input is None:
            from edgetrain.models.zoo import example_input as zoo_example

            example_input = zoo_example(model, 2, 8)
        if isinstance(example_input, torch.Tensor):
            # Features and images in the model's dtype: a float64 or bf16 model refuses float32 inputs.
            example_input = example_input.to(device, dtype=dtype if example_input.is_floating_point() else None)
        if balance not in BALANCES:
            raise EdgetrainError(f"{name}: unknown balance {balance!r}; known: {', '.join(BALANCES)}")
        self.unit_costs = probe_activation_bytes(self.view, example_input) if balance == "memory" else None
        if name == "segprop":
            self.plan: StagePlan = plan_segprop(n, head_blocks=1 if head_blocks is None else head_blocks,
                                                segments=segments, split=split, prefix=prefix,
                                                costs=self.unit_costs)
        elif name == "lw":
            self.plan = plan_lw(n, head_blocks=0 if head_blocks is None else head_blocks,
                                segments=segments, split=split, prefix=prefix, costs=self.unit_costs)
        else:
            raise EdgetrainError(f"unknown staged method {name!r}")
        self.stages = self.plan.stages
        self.budgets = self._stage_budgets(steps_per_stage)
        if lr_schedule not in LR_SCHEDULES:
            raise EdgetrainError(f"{name}: unknown lr_schedule {lr_schedule!r}; known: {', '.join(LR_SCHEDULES)}")
        if lr_schedule == "cosine" and any(b is None for b in self.budgets):
            raise EdgetrainError(f"{name}: lr_schedule='cosine' needs steps_per_stage (the length of each cosine)")
        if plateau_window < 0 or plateau_patience < 0 or (plateau_window > 0) != (plateau_patience > 0):
            raise EdgetrainError(f"{name}: plateau_window and plateau_patience go together (both > 0)")
        self.lr_schedule, self.warmup_steps = lr_schedule, int(warmup_steps)
        self.min_lr_ratio, self.head_lr_scale = float(min_lr_ratio), float(head_lr_scale)
        self.plateau = (int(plateau_window), int(plateau_patience), float(plateau_min_delta))
        self.checkpointed = bool(checkpoint)

        self.trainable_at_start = {id(p) for p in model.parameters() if p.requires_grad}
        if not self.trainable_at_start:
            raise EdgetrainError(f"{name}: {type(model).__name__} has no trainable parameters")
        self.specs, output_spec = probe_specs(self.view, example_input)
        self.num_outputs = int(output_spec[-1])
        self.adapters = self._build_adapters(adapter, adapters or {}, device, dtype, aux_head)
        # Attached so that the learner's parameter list, optimizer and checkpoints include them.
        setattr(model, ADAPTERS_ATTRIBUTE, self.adapters)

        self.snapcheck: SnapCheck | None = None
        self.snapcheck_period = None if snapcheck_period is None else int(snapcheck_period)
        if snapcheck:
            shared = self._prefix_shares_head_parameters()
            if shared:
                log.warning("%s: SnapCheck is off: the frozen prefix shares %s with the trainable head (tied "
                            "embeddings), so its outputs change every step", name, shared)
            else:
                budget = _parse_optional_bytes(snapcheck_budget)
                self.snapcheck = SnapCheck(2**62 if budget is None else budget, spill_dir=snapcheck_spill,
                                           disk_budget_bytes=_parse_optional_bytes(snapcheck_disk_budget))

        # Hooks for a distributed run (edgetrain.distributed.ddp_segprop): wrap the active path for
        # gradient sync, and reduce a step's loss across ranks (plateau decisions must agree).
        self.wrap_active: Callable[[nn.Module], nn.Module] | None = None
        self.reduce_loss: Callable[[torch.Tensor], torch.Tensor] = lambda loss: loss

        self.stage_index = 0
        self.stage_step = 0
        self.total_step = 0
        self.finished = False
        self.closed = False
        self._plateau_state = [None, 0, 0.0, 0]  # best window mean, bad windows, window sum, window count
        self._applied = False
        self._active: nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._names = {id(p): n for n, p in model.named_parameters()}

    # -- construction helpers -------------------------------------------------------------------

    def _device_dtype(self) -> tuple[torch.device, torch.dtype]:
        for param in self.model.parameters():
            if param.is_floating_point():
                return param.device, param.dtype
        return torch.device("cpu"), torch.float32

    def _stage_budgets(self, steps: int | Sequence[int] | None) -> list[int | None]:
        count = len(self.stages)
        if steps is None:
            return [None] * count
        if isinstance(steps, (int, float)) and not isinstance(steps, bool):
            budgets = [int(steps)] * count
        else:
            budgets = [int(s) for s in steps]
            if len(budgets) != count:
                raise EdgetrainError(f"{self.name}: steps_per_stage has {len(budgets)} entries for {count} stages")
        if any(b < 1 for b in budgets):
            raise EdgetrainError(f"{self.name}: steps_per_stage must be >= 1, got {budgets}")
        return budgets

    def _build_adapters(self, kind: str, given: dict[int, nn.Module], device: torch.device,
                        dtype: torch.dtype, aux_head: str) -> nn.ModuleDict:
        adapters = nn.ModuleDict()
        head_input = self.specs[self.plan.head_start] if self.name == "segprop" else self.specs[-1]
        for stage in self.stages:
            if not stage.bridge:
                continue
            key = int(stage.index)
            if key in given or str(key) in given:
                module = given.get(key, given.get(str(key)))
            else:
                module = make_adapter(self.specs[stage.end], head_input, kind, model_norm_groups(self.model))
            if self.name == "lw":
                module = AuxiliaryClassifier(module, self.view.head, head_input, self.num_outputs, aux_head)
            if module is not None:
                adapters[str(key)] = module.to(device=device, dtype=dtype)
        return adapters

    def _prefix_shares_head_parameters(self) -> str:
        head_params = {id(p) for p in _module_params([*self.view.units[self.plan.head_start:], self.view.head])}
        body = _module_params([self.view.embed, *self.view.units[:self.plan.head_start]])
        shared = [self._name_of(p) for p in body if id(p) in head_params and id(p) in self.trainable_at_start]
        return ", ".join(shared)

    def _name_of(self, param: nn.Parameter) -> str:
        return getattr(self, "_names", {}).get(id(param)) or next(
            (n for n, p in self.model.named_parameters() if p is param), "?")

    # -- the current stage ----------------------------------------------------------------------

    @property
    def stage(self) -> Stage:
        return self.stages[self.stage_index]

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def total_budget(self) -> int | None:
        return None if any(b is None for b in self.budgets) else sum(self.budgets)  # type: ignore[arg-type]

    def bridge(self, stage: Stage) -> nn.Module | None:
        return self.adapters[str(stage.index)] if str(stage.index) in self.adapters else None

    def _body_modules(self, stage: Stage) -> list[nn.Module]:
        """Modules trained on the segment's own schedule: [embed], units, bridge."""
        modules: list[nn.Module] = [self.view.embed] if stage.trains_embed else []
        modules += self.view.units[stage.start:stage.end]
        bridge = self.bridge(stage)
        return modules + ([bridge] if bridge is not None else [])

    def _head_modules(self, stage: Stage) -> list[nn.Module]:
        """Modules trained on the global head's schedule: head units and the task head."""
        modules = list(self.view.units[stage.tail_start:])
        return modules + ([self.view.head] if stage.trains_head else [])

    def _committed_modules(self, stage: Stage) -> list[nn.Module]:
        if stage.frozen_depth is None:
            return []
        return [self.view.embed, *self.view.units[:stage.frozen_depth]]

    def _build_path(self, stage: Stage) -> nn.Module:
        path = ActivePath(self.view.embed if stage.trains_embed else None, self.view.units[stage.start:stage.end],
                          self.bridge(stage), self.view.units[stage.tail_start:],
                          self.view.head if stage.trains_head else None, self.checkpointed)
        return path

    def _apply_stage(self, optimizer: torch.optim.Optimizer | None) -> None:
        """Set requires_grad, train/eval and the optimizer state for the current stage (idempotent)."""
        stage = self.stage
        body_params = _module_params(self._body_modules(stage))
        head_params = _module_params(self._head_modules(stage))
        active = {id(p) for p in body_params + head_params}
        for param in self._all_params():
            param.requires_grad_(id(param) in active and id(param) in self._trainable_ids())
        if self.name == "lw":
            # No persistent head: a stage's modules (the head-only stage's head too) share its schedule.
            body_params, head_params = body_params + head_params, []
        self._body_params = [p for p in _unique(body_params) if p.requires_grad]
        body_ids = {id(p) for p in self._body_params}
        # A parameter in both (an embedding tied to the LM head in stage 0) follows the segment.
        self._head_params = [p for p in head_params if p.requires_grad and id(p) not in body_ids]
        if not self._body_params and not self._head_params:
            raise EdgetrainError(f"{self.name}: stage {stage.index} ({stage.name}) has no trainable parameters")
        for module in [self.view.embed, *self.view.units, self.view.head, *self.adapters.values()]:
            unpin_eval(module)
        for module in self._committed_modules(stage):
            pin_eval(module)
        for module in self._body_modules(stage) + self._head_modules(stage):
            module.train(True)
        if optimizer is not None:
            # Free the state (momenta) of every parameter that no longer trains.
            for param in list(optimizer.state):
                if not param.requires_grad:
                    del optimizer.state[param]
        self._active = None  # a wrapper holding hooks on the previous stage's parameters goes first
        path = self._build_path(stage)
        self._active = self.wrap_active(path) if self.wrap_active is not None else path
        if self.snapcheck is not None:
            depth = stage.frozen_depth
            previous = self.stages[stage.index - 1].frozen_depth if stage.index > 0 else None
            self.snapcheck.retain({d for d in (depth, previous) if d is not None})
        self._applied = True

    def _trainable_ids(self) -> set[int]:
        return self.trainable_at_start | {id(p) for p in self.adapters.parameters()}

    def _all_params(self) -> list[nn.Parameter]:
        return _module_params([self.model])

    # -- the frozen prefix ----------------------------------------------------------------------

    def _stamp(self, depth: int) -> int:
        """Sum of the version counters of the prefix [embed, units[:depth]]: changes with any in-place
        write to its parameters or buffers (an optimizer step, a checkpoint load)."""
        modules = [self.view.embed, *self.view.units[:depth]]
        return sum(t._version for m in modules for t in (*m.parameters(), *m.buffers()))

    def _batch_id(self, batch: Batch) -> Hashable:
        return batch.index % self.snapcheck_period if self.snapcheck_period else batch.index

    @torch.no_grad()
    def frozen_state(self, batch: Batch) -> Any:
        """The committed prefix's output for `batch` (detached), from SnapCheck when it holds it."""
        depth = self.stage.frozen_depth
        assert depth is not None
        if self.snapcheck is None:
            return self.view.run(self.view.embed(batch.inputs), 0, depth)
        batch_id, fingerprint = self._batch_id(batch), input_fingerprint(batch.inputs)
        state = self.snapcheck.get(depth, batch_id, fingerprint, self._stamp(depth))
        if state is not None:
            return state
        nearest = self.snapcheck.nearest(depth, batch_id, fingerprint, self._stamp)
        if nearest is not None:
            # Build the new depth from the previous one: only the newly committed units run.
            shallower, state = nearest
            state = self.view.run(state, shallower, depth)
            self.snapcheck.drop(shallower, batch_id)
        else:
            state = self.view.run(self.view.embed(batch.inputs), 0, depth)
        self.snapcheck.put(depth, batch_id, state, fingerprint, self._stamp(depth))
        return state

    # -- one step -------------------------------------------------------------------------------

    def _require_open(self, optimizer: torch.optim.Optimizer | None) -> None:
        if self.closed:
            raise EdgetrainError(f"{self.name}: finish() was called; the adapters are gone and training is over")
        if optimizer is not None:
            self._optimizer = optimizer
        if not self._applied:
            self._apply_stage(self._optimizer)

    def forward_loss(self, batch: Batch) -> torch.Tensor:
        stage = self.stage
        h = batch.inputs if stage.frozen_depth is None else self.frozen_state(batch)
        assert self._active is not None
        outputs = self._active(h)
        return task_loss(self.model, outputs, batch.targets)

    def gradients(self, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Loss and gradients of the parameters the current stage trains (no update)."""
        self._require_open(None)
        params = self._body_params + self._head_params
        for param in params:
            param.grad = None
        loss = self.forward_loss(batch)
        loss.backward()
        grads = {}
        for param in params:
            grads[self._name_of(param)] = param.grad if param.grad is not None else torch.zeros_like(param)
            param.grad = None
        return self.reduce_loss(loss.detach()), grads

    def step(self, batch: Batch, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        self._require_open(optimizer)
        optimizer.zero_grad(set_to_none=True)
        loss = self.forward_loss(batch)
        require_finite(float(loss.detach()), "loss")
        loss.backward()
        self._update(optimizer)
        reduced = self.reduce_loss(loss.detach())
        self._after_step(float(reduced))
        return reduced

    def lr_multipliers(self) -> tuple[float, float]:
        """(segment, global head) multipliers of the optimizer's lr at the current step."""
        if self.lr_schedule == "constant":
            return 1.0, self.head_lr_scale
        budget = self.budgets[self.stage_index]
        assert budget is not None and self.total_budget is not None
        segment = cosine_multiplier(self.stage_step, budget, self.warmup_steps, self.min_lr_ratio)
        head = cosine_multiplier(self.total_step, self.total_budget, self.warmup_steps, self.min_lr_ratio)
        return segment, head * self.head_lr_scale

    def _update(self, optimizer: torch.optim.Optimizer) -> None:
        for param in self._body_params + self._head_params:
            if param.grad is not None and not bool(torch.isfinite(param.grad).all()):
                optimizer.zero_grad(set_to_none=True)
                raise NonFiniteError(f"non-finite gradient in {self._name_of(param)}")
        segment, head = self.lr_multipliers()
        if segment == head:
            self._scaled_step(optimizer, segment)
        else:
            # Two sub-steps with different rates; the optimizer skips parameters without a gradient.
            head_grads = [p.grad for p in self._head_params]
            for param in self._head_params:
                param.grad = None
            self._scaled_step(optimizer, segment)
            for param in self._body_params:
                param.grad = None
            for param, grad in zip(self._head_params, head_grads):
                param.grad = grad
            self._scaled_step(optimizer, head)
        optimizer.zero_grad(set_to_none=True)

    @staticmethod
    def _scaled_step(optimizer: torch.optim.Optimizer, multiplier: float) -> None:
        if multiplier == 1.0:
            optimizer.step()
            return
        rates = [group["lr"] for group in optimizer.param_groups]
        try:
            for group in optimizer.param_groups:
                group["lr"] = group["lr"] * multiplier
            optimizer.step()
        finally:
            for group, rate in zip(optimizer.param_groups, rates):
                group["lr"] = rate

    def _after_step(self, loss: float) -> None:
        self.stage_step += 1
        self.total_step += 1
        if self._plateau_reached(loss) or self.stage_step == self.budgets[self.stage_index]:
            self.advance_stage()

    def _plateau_reached(self, loss: float) -> bool:
        window, patience, min_delta = self.plateau
        if window == 0:
            return False
        state = self._plateau_state
        state[2] += loss
        state[3] += 1
        if state[3] < window:
            return False
        mean = state[2] / state[3]
        state[2], state[3] = 0.0, 0
        if state[0] is None or mean < state[0] * (1 - min_delta):
            state[0], state[1] = mean, 0
            return False
        state[1] += 1
        return state[1] >= patience

    def advance_stage(self) -> None:
        """Commit the current stage and start the next (the last one just reports `finished`)."""
        if self.stage_index + 1 >= self.num_stages:
            self.finished = True
            return
        self.stage_index += 1
        self.stage_step = 0
        self._plateau_state = [None, 0, 0.0, 0]
        self._apply_stage(self._optimizer)

    # -- evaluation -----------------------------------------------------------------------------

    @torch.no_grad()
    def path_forward(self, inputs: torch.Tensor, stage: int | None = None) -> Any:
        """The outputs of a stage's training path (adapter or auxiliary classifier included), without
        autograd or SnapCheck; the paper's "Test (aux)"."""
        target = self.stages[self.stage_index if stage is None else stage]
        path = self._build_path(target)
        modules = [self.view.embed, *self.view.units, self.view.head, *self.adapters.values()]
        modes = [(m, m.training) for module in modules for m in module.modules()]
        try:
            for module in modules:
                nn.Module.train(module, False)
            h = inputs
            if target.frozen_depth is not None:
                h = self.view.run(self.view.embed(inputs), 0, target.frozen_depth)
            return path(h)
        finally:
            for m, mode in modes:
                m.training = mode

    # -- finishing ------------------------------------------------------------------------------

    def finish(self) -> nn.Module:
        """Discard the adapters, unpin every module, restore requires_grad as it was before training;
        returns the plain model (its forward is the assembled blocks). Training ends here."""
        if self.closed:
            return self.model
        adapter_ids = {id(p) for p in self.adapters.parameters()}
        if self._optimizer is not None:
            # Out of the optimizer too (state and param groups), or it would keep the adapters alive.
            for param in [p for p in self._optimizer.state if id(p) in adapter_ids]:
                del self._optimizer.state[param]
            for group in self._optimizer.param_groups:
                group["params"] = [p for p in group["params"] if id(p) not in adapter_ids]
        for module in [self.view.embed, *self.view.units, self.view.head]:
            unpin_eval(module)
        if hasattr(self.model, ADAPTERS_ATTRIBUTE):
            delattr(self.model, ADAPTERS_ATTRIBUTE)
        for param in self.model.parameters():
            param.requires_grad_(id(param) in self.trainable_at_start)
        self._active = None
        if self.snapcheck is not None:
            self.snapcheck.close()
        self.model.train()
        self.closed = True
        return self.model

    def close(self) -> None:
        if self.snapcheck is not None:
            self.snapcheck.close()

    # -- checkpoint state -------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.name, "split": list(self.plan.split), "stage": self.stage_index,
                "stage_step": self.stage_step, "total_step": self.total_step, "finished": self.finished,
                "plateau": list(self._plateau_state)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        same_plan = list(state.get("split", self.plan.split)) == list(self.plan.split)
        if state.get("kind", self.name) != self.name or not same_plan:
            raise EdgetrainError(f"{self.name}: checkpoint was written for a different plan "
                                 f"({state.get('kind')}, split {state.get('split')}); this run has "
                                 f"{self.name}, split {list(self.plan.split)}")
        self.stage_index = int(state["stage"])
        self.stage_step = int(state["stage_step"])
        self.total_step = int(state["total_step"])
        self.finished = bool(state.get("finished", False))
        plateau = list(state.get("plateau", [None, 0, 0.0, 0]))
        self._plateau_state = [plateau[0], int(plateau[1]), float(plateau[2]), int(plateau[3])]
        if self.snapcheck is not None:
            self.snapcheck.drop()
        self._applied = False  # re-applied (requires_grad, eval pins, optimizer state) on the next step
