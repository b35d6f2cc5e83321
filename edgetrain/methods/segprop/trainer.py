"""The stage-by-stage trainer behind `segprop` and `lw`: a TrainingMethod whose `step(batch, optimizer)`
is one step of the current stage; the stage advances by itself.

What a stage does to the model (SegProp Algorithm 1):
  * committed units (everything before the stage's first unit, the embedding included) get
    requires_grad=False and are pinned in eval() (eval_pins.py), so their BatchNorm statistics never
    move again; their forward runs under no_grad, its output detached (or comes from SnapCheck);
  * the active units, the stage's adapter (segprop) or auxiliary classifier (lw), the global-head units
    and the head train; units after the stage are off the loss path and frozen;
  * optimizer state of every parameter that stops training is freed at the stage change.
Adapters live in `model.stage_adapters` while training, so the learner's optimizer and checkpoints
cover them; `finish()` deletes them, unpins everything and restores requires_grad: what is left is
the plain model, whose forward is the assembled blocks.

Only parameters that were trainable when the method was built ever train (LoRA: the adapters inside
the active segment and the head; the base weights stay frozen).

The schedule, the stage parts, the frozen prefix, the eval() pins, evaluation and the backward split at
the head each have a module of their own (segprop/__init__.py lists them); this class ties them together.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn

from edgetrain.data.batch import Batch
from edgetrain.utils.logs import get_logger
from edgetrain.training.losses import task_loss
from edgetrain.methods.base import NonFiniteError, require_finite
from edgetrain.methods.segprop import head_last
from edgetrain.methods.segprop.eval_pins import unpin_eval
from edgetrain.methods.segprop.evaluation import path_forward
from edgetrain.methods.segprop.plan import Stage, StagePlan, plan_stages
from edgetrain.methods.segprop.prefix_cache import FrozenPrefix, make_snapcheck
from edgetrain.methods.segprop.schedule import make_clock
from edgetrain.methods.segprop.snapcheck import SnapCheck
from edgetrain.methods.segprop.stage_parts import ActivePath, StageParts, build_bridges, module_params, unique
from edgetrain.methods.segprop.views import (UnitView, model_device_dtype, probe_activation_bytes, probe_input,
                                             probe_specs, unit_view)
from edgetrain.methods.segprop.waiting_spill import WaitingSpill, check_options as check_spill, waiting_tensors
from edgetrain.registry import EdgetrainError

log = get_logger(__name__)
ADAPTERS_ATTRIBUTE = "stage_adapters"
BALANCES = ("blocks", "memory")


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
      head_grads_last segprop: split each step's backward at the global head, so that the head's
                      parameter gradients are computed after the segment's backward instead of before
                      it (head_last.py); same updates, lower peak when the head's trainable
                      weights outweigh the activations it saves (a CNN whose head holds most weights);
                      not for LoRA heads or large vocabularies, where the opposite holds
      snapcheck       cache frozen-prefix outputs (snapcheck.py): `snapcheck_budget` in memory (None =
                      no limit), spilled to `snapcheck_spill` ("auto" = a temporary directory, None =
                      drop) up to `snapcheck_disk_budget`; batch id = batch.index, or batch.index % snapcheck_period
                      for a stream whose order repeats every snapcheck_period batches
      spill_waiting   keep the weights of units whose stage has not begun in a file, mapped copy-on-write, not
                      in memory, under `spill_waiting_dir` ("auto" = a temp directory); exact; CPU (waiting_spill.py)
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
                 checkpoint: bool = False, head_grads_last: bool = False, snapcheck: bool = False,
                 snapcheck_budget: Any = "256MiB",
                 snapcheck_spill: str | None = "auto", snapcheck_disk_budget: Any = "2GiB",
                 snapcheck_period: int | None = None, spill_waiting: bool = False,
                 spill_waiting_dir: str = "auto", adapter: str = "auto", aux_head: str = "auto",
                 adapters: dict[int, nn.Module] | None = None, example_input: Any = None) -> None:
        self.name = name
        self.model = model
        if hasattr(model, ADAPTERS_ATTRIBUTE):
            raise EdgetrainError(f"{name}: the model already carries model.{ADAPTERS_ATTRIBUTE} (another staged "
                                 "method is attached; call its finish() first)")
        self.view: UnitView = unit_view(model, view)
        n = len(self.view)
        device, dtype = model_device_dtype(model)
        example_input = probe_input(model, example_input, device, dtype)
        if balance not in BALANCES:
            raise EdgetrainError(f"{name}: unknown balance {balance!r}; known: {', '.join(BALANCES)}")
        self.unit_costs = probe_activation_bytes(self.view, example_input) if balance == "memory" else None
        self.plan: StagePlan = plan_stages(name, n, head_blocks=head_blocks, segments=segments, split=split,
                                           prefix=prefix, costs=self.unit_costs)
        self.stages = self.plan.stages
        self.clock = make_clock(name, len(self.stages), steps_per_stage, plateau_window, plateau_patience,
                                plateau_min_delta, lr_schedule, warmup_steps, min_lr_ratio, head_lr_scale)

        self.trainable_at_start = {id(p) for p in model.parameters() if p.requires_grad}
        if not self.trainable_at_start:
            raise EdgetrainError(f"{name}: {type(model).__name__} has no trainable parameters")
        self.specs, output_spec = probe_specs(self.view, example_input)
        self.num_outputs = int(output_spec[-1])
        self.adapters = build_bridges(name, self.plan, self.view, self.specs, self.num_outputs, model, adapter,
                                      adapters or {}, device, dtype, aux_head)
        self.parts = StageParts(self.view, self.adapters, bool(checkpoint))
        self.head_grads_last = head_last.check_option(name, head_grads_last)
        self.waiting: WaitingSpill | None = check_spill(name, spill_waiting, spill_waiting_dir, device)
        # Attached so that the learner's parameter list, optimizer and checkpoints include them.
        setattr(model, ADAPTERS_ATTRIBUTE, self.adapters)
        self._names = {id(p): n for n, p in model.named_parameters()}

        cache: SnapCheck | None = None
        if snapcheck:
            shared = ", ".join(self._name_of(p) for p in self.parts.prefix_shared_with_head(
                self.plan, self.trainable_at_start))
            if shared:
                log.warning("%s: SnapCheck is off: the frozen prefix shares %s with the trainable head (tied "
                            "embeddings), so its outputs change every step", name, shared)
            else:
                cache = make_snapcheck(snapcheck_budget, snapcheck_spill, snapcheck_disk_budget)
        self.prefix = FrozenPrefix(self.view, cache, None if snapcheck_period is None else int(snapcheck_period))

        # Hooks for a distributed run (edgetrain.recipes.ddp_segprop): wrap the active path for
        # gradient sync, and reduce a step's loss across ranks (plateau decisions must agree).
        self.wrap_active: Callable[[nn.Module], nn.Module] | None = None
        self.reduce_loss: Callable[[torch.Tensor], torch.Tensor] = lambda loss: loss

        self.closed = False
        self._applied = False
        self._active: nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._body_params: list[nn.Parameter] = []
        self._head_params: list[nn.Parameter] = []
        self._path: ActivePath | None = None
        self._head_grad_params: list[nn.Parameter] = []

    def _name_of(self, param: nn.Parameter) -> str:
        return self._names.get(id(param)) or next((n for n, p in self.model.named_parameters() if p is param), "?")

    # -- where the schedule stands (schedule.py) ----------------------------------------------------

    @property
    def stage(self) -> Stage:
        return self.stages[self.clock.stage_index]

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def stage_index(self) -> int:
        return self.clock.stage_index

    @property
    def stage_step(self) -> int:
        return self.clock.stage_step

    @property
    def total_step(self) -> int:
        return self.clock.total_step

    @property
    def finished(self) -> bool:
        return self.clock.finished

    @property
    def budgets(self) -> list[int | None]:
        return self.clock.budgets

    @property
    def total_budget(self) -> int | None:
        return self.clock.total_budget

    @property
    def snapcheck(self) -> SnapCheck | None:
        return self.prefix.snapcheck

    def lr_multipliers(self) -> tuple[float, float]:
        """(segment, global head) multipliers of the optimizer's lr at the current step."""
        return self.clock.lr_multipliers()

    # -- what a stage trains (stage_parts.py) --------------------------------------------------------

    def bridge(self, stage: Stage) -> nn.Module | None:
        return self.parts.bridge(stage)

    def _body_modules(self, stage: Stage) -> list[nn.Module]:
        return self.parts.body(stage)

    def _head_modules(self, stage: Stage) -> list[nn.Module]:
        return self.parts.head(stage)

    def _trainable_ids(self) -> set[int]:
        return self.trainable_at_start | {id(p) for p in self.adapters.parameters()}

    def _apply_stage(self, optimizer: torch.optim.Optimizer | None) -> None:
        """Set requires_grad, train/eval and the optimizer state for the current stage (idempotent)."""
        stage = self.stage
        body_params = module_params(self.parts.body(stage))
        head_params = module_params(self.parts.head(stage))
        active = {id(p) for p in body_params + head_params}
        trainable = self._trainable_ids()
        for param in module_params([self.model]):
            param.requires_grad_(id(param) in active and id(param) in trainable)
        if self.name == "lw":
            # No persistent head: a stage's modules (the head-only stage's head too) share its schedule.
            body_params, head_params = body_params + head_params, []
        self._body_params = [p for p in unique(body_params) if p.requires_grad]
        body_ids = {id(p) for p in self._body_params}
        # A parameter in both (an embedding tied to the LM head in stage 0) follows the segment.
        self._head_params = [p for p in head_params if p.requires_grad and id(p) not in body_ids]
        if not self._body_params and not self._head_params:
            raise EdgetrainError(f"{self.name}: stage {stage.index} ({stage.name}) has no trainable parameters")
        for module in self.parts.all_modules():
            unpin_eval(module)
        self.adapters.pin(self.parts.committed(stage))
        for module in self.parts.body(stage) + self.parts.head(stage):
            module.train(True)
        self.adapters.keep_pinned_in_eval()  # committed wins over an active module that contains it
        if optimizer is not None:
            # Free the state (momenta) of every parameter that no longer trains.
            for param in list(optimizer.state):
                if not param.requires_grad:
                    del optimizer.state[param]
        self._active = None  # a wrapper holding hooks on the previous stage's parameters goes first
        path = self.parts.path(stage)
        # Every trainable parameter the head modules use, a tied one that follows the segment's
        # schedule included: the head's share of its gradient comes from the last backward.
        self._head_grad_params = [p for p in module_params(self.parts.head(stage)) if p.requires_grad]
        path.keep_head_input = self._splits_backward()
        self._path = path
        self._active = self.wrap_active(path) if self.wrap_active is not None else path
        depth = stage.frozen_depth
        previous = self.stages[stage.index - 1].frozen_depth if stage.index > 0 else None
        self.prefix.retain({d for d in (depth, previous) if d is not None})
        if self.waiting is not None:  # the current values, so a re-applied stage (after a load) maps no stale ones
            self.waiting.apply(waiting_tensors(self.parts, stage))
        self._applied = True

    # -- one step -----------------------------------------------------------------------------------

    def _splits_backward(self) -> bool:
        """Whether this stage's steps split the backward at the global head (head_last.applies)."""
        return head_last.applies(self.head_grads_last, self.name, self.parts.checkpointed, self.wrap_active is not None,
                                 self._body_params, self._head_grad_params)

    def frozen_state(self, batch: Batch) -> Any:
        """The committed prefix's output for `batch` (detached), from SnapCheck when it holds it."""
        depth = self.stage.frozen_depth
        assert depth is not None
        return self.prefix.state(batch, depth)

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
        if self._path is not None:
            self._path.take_head_input()  # one ordinary backward here: no reference may outlive it
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
        # Taken before anything can raise: a head input left on the path would keep the graph alive. There
        # is one only where the stage splits its backward (head_last.py); without, one ordinary backward.
        head_input = self._path.take_head_input() if self._path is not None else []
        require_finite(float(loss.detach()), "loss")
        head_last.backward(loss, head_input, self._head_grad_params)
        self._update(optimizer)
        reduced = self.reduce_loss(loss.detach())
        if self.clock.tick(float(reduced)):
            self.advance_stage()
        return reduced

    def _update(self, optimizer: torch.optim.Optimizer) -> None:
        for param in self._body_params + self._head_params:
            if param.grad is not None and not bool(torch.isfinite(param.grad).all()):
                optimizer.zero_grad(set_to_none=True)
                raise NonFiniteError(f"non-finite gradient in {self._name_of(param)}")
        segment, head = self.lr_multipliers()
        if segment == head:
            _scaled_step(optimizer, segment)
        else:
            # Two sub-steps with different rates; the optimizer skips parameters without a gradient.
            head_grads = [p.grad for p in self._head_params]
            for param in self._head_params:
                param.grad = None
            _scaled_step(optimizer, segment)
            for param in self._body_params:
                param.grad = None
            for param, grad in zip(self._head_params, head_grads):
                param.grad = grad
            _scaled_step(optimizer, head)
        optimizer.zero_grad(set_to_none=True)

    def advance_stage(self) -> None:
        """Commit the current stage and start the next (the last one just reports `finished`)."""
        if self.clock.next_stage():
            self._apply_stage(self._optimizer)

    # -- evaluation, finishing, checkpoint state ------------------------------------------------------

    def path_forward(self, inputs: torch.Tensor, stage: int | None = None) -> Any:
        """The outputs of a stage's training path (adapter or auxiliary classifier included), without
        autograd or SnapCheck; the paper's "Test (aux)"."""
        return path_forward(self.parts, self.stages[self.stage_index if stage is None else stage], inputs)

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
        self.adapters.release()
        for module in [self.view.embed, *self.view.units, self.view.head]:
            unpin_eval(module)
        if hasattr(self.model, ADAPTERS_ATTRIBUTE):
            delattr(self.model, ADAPTERS_ATTRIBUTE)
        for param in self.model.parameters():
            param.requires_grad_(id(param) in self.trainable_at_start)
        self._active = None
        self.close()
        self.model.train()
        self.closed = True
        return self.model

    def close(self) -> None:
        self.prefix.close()
        if self.waiting is not None:
            self.waiting.restore_all()

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.name, "split": list(self.plan.split), **self.clock.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        same_plan = list(state.get("split", self.plan.split)) == list(self.plan.split)
        if state.get("kind", self.name) != self.name or not same_plan:
            raise EdgetrainError(f"{self.name}: checkpoint was written for a different plan "
                                 f"({state.get('kind')}, split {state.get('split')}); this run has "
                                 f"{self.name}, split {list(self.plan.split)}")
        self.clock.load_state_dict(state)
        self.prefix.drop()
        self._applied = False  # re-applied (requires_grad, eval pins, optimizer state) on the next step


def _scaled_step(optimizer: torch.optim.Optimizer, multiplier: float) -> None:
    """optimizer.step() at `multiplier` times each group's lr; the rates are put back afterwards."""
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
