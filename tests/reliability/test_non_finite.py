"""Nothing lost, nothing trusted: a step that meets a NaN/inf -- in the loss, in the gradient (or the
method's estimate of it: MeZO's projected gradient, a forward gradient's directional derivative), or
in the update itself (finite numbers whose product overflows the weights' dtype) -- raises
TrainingError (an EdgetrainError) and changes nothing: weights and optimizer state are bit for bit the
ones before the step, and a checkpoint written after the failure is byte for byte the one written
before it. Training then goes on from there.

Every method is driven through the Learner, as an app drives it. Overflow cases give the parameters two
learning rates (a small one for the first blocks, a large one for the last): the first parameters'
updates are finite and only later ones overflow, so an update that writes each parameter as soon as its
own check passes would leave the first ones changed."""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch import nn

import edgetrain
from edgetrain.data.batch import Batch
from edgetrain.training.checkpoint import load_safetensors_checked
from edgetrain.training.learner import TrainingError
from edgetrain.models.mlp import MLPConfig, build_mlp
from edgetrain.registry import EdgetrainError

pytestmark = pytest.mark.usefixtures("one_thread")

NAN, INF = float("nan"), float("inf")
Fault = Callable[[edgetrain.Learner, pytest.MonkeyPatch], Callable[[], None]]


# -- faults: each installs itself and returns its removal ---------------------------------------------

def logits_times(value: float) -> Fault:
    def install(learner: edgetrain.Learner, monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
        return learner.model.head.register_forward_hook(lambda module, args, out: out * value).remove
    return install


def gradient_of_one_adapter(make: Callable[[torch.Tensor], torch.Tensor]) -> Fault:
    """A hook on the gradient of the last block's q adapter (the loss stays finite)."""
    def install(learner: edgetrain.Learner, monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
        return learner.model.blocks[-1].self_attn.q_proj.lora_B.register_hook(make).remove
    return install


def mesp_loss_times(value: float) -> Fault:
    # MeSP computes the loss from the head's weights itself; a forward hook would not see it.
    import edgetrain.methods.mesp.method as mesp

    def install(learner: edgetrain.Learner, monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
        real = mesp.chunked_lm_loss

        def poisoned(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            loss, grad = real(*args, **kwargs)
            return loss * value, grad
        monkeypatch.setattr(mesp, "chunked_lm_loss", poisoned)
        return monkeypatch.undo
    return install


def mesp_gradients(make: Callable[[torch.Tensor], torch.Tensor]) -> Fault:
    """Block 0's hand-derived adapter gradients replaced by make(gradient). The backward walks the
    blocks last to first, so with a fused update blocks 3, 2, 1 are already stepped when block 0 fails."""
    import edgetrain.methods.mesp.compiled as mesp  # where a step takes its block programs from

    def install(learner: edgetrain.Learner, monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
        real, calls = mesp.block_backward, []

        def poisoned(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            grad, block_grads = real(*args, **kwargs)
            calls.append(1)
            if len(calls) % len(learner.model.blocks):
                return grad, block_grads
            return grad, {name: make(g) for name, g in block_grads.items()}
        monkeypatch.setattr(mesp, "block_backward", poisoned)
        return monkeypatch.undo
    return install


def mezo_losses(plus: float, minus: float) -> Fault:
    """L(theta + eps z) and L(theta - eps z) as given (finite), so the projected gradient is
    (plus - minus) / 2 eps."""
    def install(learner: edgetrain.Learner, monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
        monkeypatch.setattr(learner.method, "_loss_at",
                            lambda batch, directions, sign: torch.tensor(plus if sign > 0 else minus))
        return monkeypatch.undo
    return install


def directional_derivatives(value: float) -> Fault:
    """The real loss, but every directional derivative replaced by `value` (fgd, and asyncfgd's last module)."""
    def install(learner: edgetrain.Learner, monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
        method = learner.method
        stage = method.stage if hasattr(method, "stage") else method.stages[-1]
        real = stage.loss_derivatives
        monkeypatch.setattr(stage, "loss_derivatives",
                            lambda *args: (real(*args)[0], [value] * method.num_tangents))
        return monkeypatch.undo
    return install


def two_rate_sgd(**options: Any) -> Callable[[nn.Module], Callable]:
    """SGD with lr 1e-3 for the first two blocks' adapters and lr 1 for the last two's."""
    def for_model(model: nn.Module) -> Callable:
        late = {id(p) for block in model.blocks[2:] for p in block.parameters()}

        def build(params: list[nn.Parameter]) -> torch.optim.Optimizer:
            return torch.optim.SGD([{"params": [p for p in params if id(p) not in late], "lr": 1e-3},
                                    {"params": [p for p in params if id(p) in late], "lr": 1.0}], **options)
        return build
    return for_model


@dataclass
class Case:
    method: str
    fault: Fault
    message: str
    optimizer: str | Callable[[nn.Module], Callable] = "adamw"
    lr: float = 1e-3
    optimizer_options: dict[str, Any] = field(default_factory=dict)
    method_options: dict[str, Any] = field(default_factory=dict)
    lora: dict[str, Any] = field(default_factory=dict)


MOMENTUM = {"momentum": 0.9}
ASYNC = {"num_modules": 2, "runtime": "reference"}
ASYNC_THREADS = {"num_modules": 2, "runtime": "threads", "pin_workers": False}
CASES = {
    # The loss. (LoRA dropout draws from the torch RNG during the failed forward; the RNG is put back.)
    "bp-nan-loss": Case("bp", logits_times(NAN), "non-finite loss", lora={"dropout": 0.1}),
    "bp-inf-loss": Case("bp", logits_times(INF), "non-finite loss"),
    "mebp-nan-loss": Case("mebp", logits_times(NAN), "non-finite loss"),
    "mesp-nan-loss": Case("mesp", mesp_loss_times(NAN), "non-finite loss"),
    "mesp-fused-inf-loss": Case("mesp", mesp_loss_times(INF), "non-finite loss",
                                method_options={"fused_update": True}),
    "mezo-nan-loss": Case("mezo", logits_times(NAN), r"non-finite loss at theta \+ eps z", optimizer="sgd"),
    "mezo-inf-loss": Case("mezo", logits_times(INF), "non-finite loss at theta", optimizer="sgd"),
    "fgd-nan-loss": Case("fgd", logits_times(NAN), "non-finite loss", optimizer="sgd"),
    "asyncfgd-inf-loss": Case("asyncfgd", logits_times(INF), "non-finite loss", optimizer="sgd",
                              method_options=ASYNC),
    # The gradient, or the method's estimate of it.
    "bp-nan-gradient": Case("bp", gradient_of_one_adapter(lambda g: g * NAN), "non-finite gradient"),
    "mebp-inf-gradient": Case("mebp", gradient_of_one_adapter(lambda g: g * INF), "non-finite gradient"),
    "mesp-fused-nan-gradient": Case("mesp", mesp_gradients(lambda g: g * NAN), "non-finite gradient",
                                    method_options={"fused_update": True}),
    "mezo-inf-projected-gradient": Case("mezo", mezo_losses(3e38, -3e38), "non-finite projected gradient",
                                        optimizer="sgd"),
    "fgd-nan-derivative": Case("fgd", directional_derivatives(NAN), "non-finite directional derivative",
                               optimizer="sgd"),
    "asyncfgd-nan-derivative": Case("asyncfgd", directional_derivatives(NAN), "non-finite loss or directional",
                                    optimizer="sgd", method_options=ASYNC),
    # The update: finite gradients whose step overflows float32.
    "bp-sgd-overflow": Case("bp", gradient_of_one_adapter(lambda g: torch.full_like(g, 3e38)),
                            "sgd: the update of blocks.3.self_attn.q_proj.lora_B would make it non-finite",
                            optimizer="sgd", lr=10.0),
    "bp-momentum-overflow": Case("bp", gradient_of_one_adapter(lambda g: torch.full_like(g, 3e38)),
                                 "SGD: the update of blocks.3.self_attn.q_proj.lora_B came out non-finite",
                                 optimizer="sgd", lr=10.0, optimizer_options=MOMENTUM),
    "mesp-fused-momentum-overflow": Case("mesp", mesp_gradients(lambda g: torch.full_like(g, 3e38)),
                                         "came out non-finite", optimizer="sgd", lr=10.0,
                                         optimizer_options=MOMENTUM, method_options={"fused_update": True}),
    "mezo-in-place-overflow": Case("mezo", mezo_losses(3e35, -3e35), "mezo: the update of blocks.2.* would make "
                                   "it non-finite", optimizer=two_rate_sgd()),
    "mezo-momentum-overflow": Case("mezo", mezo_losses(5e34, -5e34), "SGD: the update of .* came out non-finite",
                                   optimizer="sgd", lr=10.0, optimizer_options=MOMENTUM),
    "fgd-in-place-overflow": Case("fgd", directional_derivatives(3e38), "fgd: the update of blocks.2.* would make "
                                  "it non-finite", optimizer=two_rate_sgd()),
    "fgd-momentum-overflow": Case("fgd", directional_derivatives(5e37), "SGD: the update of .* came out non-finite",
                                  optimizer="sgd", lr=10.0, optimizer_options=MOMENTUM),
    "asyncfgd-in-place-overflow": Case("asyncfgd", directional_derivatives(3e38), "asyncfgd: the update of "
                                       "blocks.2.* would make it non-finite", optimizer=two_rate_sgd(),
                                       method_options=ASYNC),
    "asyncfgd-threads-in-place-overflow": Case("asyncfgd", directional_derivatives(3e38), "asyncfgd: the update "
                                               "of blocks.2.* would make it non-finite", optimizer=two_rate_sgd(),
                                               method_options=ASYNC_THREADS),
}


def _learner(case: Case, tiny_lora: Callable[..., nn.Module]) -> edgetrain.Learner:
    model = tiny_lora(**case.lora)
    optimizer = case.optimizer if isinstance(case.optimizer, str) else case.optimizer(model)
    return edgetrain.Learner(model, method=case.method, optimizer=optimizer, lr=case.lr, probe=False,
                             optimizer_options=case.optimizer_options if isinstance(optimizer, str) else None,
                             method_options=case.method_options)


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in [*model.named_parameters(), *model.named_buffers()]}


def _checkpoint(learner: edgetrain.Learner, path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """What a checkpoint written now holds (tensors, and the JSON state in its metadata), read back.
    (Not its bytes: safetensors writes the metadata keys in no fixed order.)"""
    tensors, metadata = load_safetensors_checked(learner.save(path))
    return tensors, json.loads(metadata["state"])


def _same(a: Any, b: Any) -> bool:
    """Bit-for-bit equality of nested optimizer state (tensors compared with torch.equal)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


@pytest.mark.parametrize("name", list(CASES))
def test_a_failed_step_changes_no_weight_no_optimizer_state_and_no_checkpoint(
        name: str, tiny_lora, text_batches, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    case = CASES[name]
    learner = _learner(case, tiny_lora)
    batches = text_batches(4)
    for batch in batches[:2]:  # optimizer state exists (and asyncfgd's pipeline is full)
        learner.step(batch)
    weights, optimizer_state = _weights(learner.model), copy.deepcopy(learner.optimizer.state_dict())
    saved_before = _checkpoint(learner, tmp_path / "before.safetensors")

    remove_fault = case.fault(learner, monkeypatch)
    with pytest.raises(TrainingError, match=case.message) as failure:
        learner.step(batches[2])
    remove_fault()

    assert isinstance(failure.value, EdgetrainError) and "batch 2" in str(failure.value)
    after = _weights(learner.model)
    changed = [k for k in weights if not torch.equal(weights[k], after[k])]
    assert changed == []
    assert _same(optimizer_state, learner.optimizer.state_dict())
    assert all(p.grad is None for p in learner.params.values())
    assert learner.steps_done == 2
    saved_after = _checkpoint(learner, tmp_path / "after.safetensors")
    if case.method == "asyncfgd":
        # By design the pipeline moved on (the bad sample left it, the batch entered): only the method's
        # own state differs.
        before_method, after_method = saved_before[1].pop("method"), saved_after[1].pop("method")
        assert after_method["steps_taken"] == before_method["steps_taken"] + 1
    assert _same(saved_after, saved_before)

    assert learner.step(batches[3]).step == 3  # training goes on
    assert any(not torch.equal(weights[k], p) for k, p in learner.params.items())


# -- genuine float16 overflow: finite numbers everywhere, only the written value overflows ------------

def _half_mlp() -> nn.Module:
    return build_mlp(MLPConfig(input_shape=(8,), hidden_sizes=(6, 5), num_classes=3, activation="relu",
                               seed=0)).half()


def _half_batch() -> Batch:
    generator = torch.Generator().manual_seed(0)
    # Large features give a large loss slope, so a large (allowed) lr gives steps near float16's limit.
    return Batch((torch.randn(12, 8, generator=generator) * 100).half(),
                 torch.randint(0, 3, (12,), generator=generator), 0)


@pytest.mark.parametrize("method,lr,options", [
    ("mezo", 2500.0, {"epsilon": 1e-2}),  # |lr * g| = 5.1e4 fits float16 (max 65504); lr * g * z does not
    ("fgd", 5000.0, {}),  # |lr * dL/du| = 5.3e4, the same for a forward gradient
])
def test_a_float16_update_that_overflows_is_refused_before_it_is_written(method: str, lr: float,
                                                                         options: dict[str, Any]):
    model = _half_mlp()
    learner = edgetrain.Learner(model, method=method, lr=lr, probe=False, method_options=options)
    weights = _weights(model)
    with pytest.raises(TrainingError, match=f"{method}: the update of .* would make it non-finite "
                                            r"\(torch.float16 overflow\)"):
        learner.step(_half_batch())
    assert all(torch.equal(weights[k], v) for k, v in _weights(model).items())


def test_a_step_size_that_does_not_fit_float16_is_refused_by_name():
    # torch itself would fail inside SGD with "value cannot be converted to type c10::Half".
    learner = edgetrain.Learner(_half_mlp(), method="bp", lr=1e6, probe=False)
    with pytest.raises(TrainingError, match=r"sgd: the update step -1e\+06 of blocks.0.linear.weight overflows "
                                            "torch.float16"):
        learner.step(_half_batch())


def test_a_failed_step_puts_back_batchnorm_statistics():
    # The failed forward updated the running statistics with a NaN batch statistic before the loss was seen.
    model = build_mlp(MLPConfig(input_shape=(8,), hidden_sizes=(6,), num_classes=3, batch_norm=True, seed=0))
    learner = edgetrain.Learner(model, method="fgd", probe=False)
    generator = torch.Generator().manual_seed(1)
    batch = Batch(torch.randn(12, 8, generator=generator), torch.randint(0, 3, (12,), generator=generator), 0)
    learner.step(batch)
    before = _weights(model)
    poison = model.blocks[0].linear.register_forward_hook(lambda module, args, out: out * NAN)
    with pytest.raises(TrainingError, match="non-finite loss"):
        learner.step(batch)
    poison.remove()
    assert all(torch.equal(before[k], v) for k, v in _weights(model).items())


# -- options: refused when the method is built, not as a NaN several steps later -----------------------

@pytest.mark.parametrize("method,options,message", [
    ("mezo", {"epsilon": 0}, "mezo: epsilon must be a finite positive number, got 0"),
    ("mezo", {"epsilon": -1e-3}, "epsilon must be a finite positive number"),
    ("mezo", {"epsilon": NAN}, "epsilon must be a finite positive number, got nan"),
    ("mezo", {"epsilon": INF}, "epsilon must be a finite positive number, got inf"),
    ("mezo", {"epsilon": "1e-3"}, r"epsilon must be a finite positive number, got '1e-3' \(str\)"),
    ("mezo", {"epsilon": True}, r"epsilon must be a finite positive number, got True \(bool\)"),
    ("mezo", {"epsilon": None}, "epsilon must be a finite positive number, got None"),
    ("mezo", {"seed": 1.5}, "mezo: seed must be an integer"),
    ("fgd", {"alpha": NAN}, r"fgd: alpha\[''\] = nan: must be in \[0, 1\]"),
    ("fgd", {"alpha": INF}, r"alpha\[''\] = inf: must be in \[0, 1\]"),
    ("fgd", {"alpha": "0.5"}, "fgd: alpha must be a number or a {name prefix: number} dict, got '0.5'"),
    ("fgd", {"alpha": True}, "alpha must be a number or a"),
    ("fgd", {"alpha": {"blocks.0": "0.5"}}, r"fgd: alpha\['blocks.0'\] = '0.5': alpha maps parameter-name"),
    ("fgd", {"alpha": {"blocks.0": None}}, r"alpha\['blocks.0'\] = None"),
    ("fgd", {"num_tangents": 0}, "fgd: num_tangents must be a positive integer, got 0"),
    ("fgd", {"num_tangents": True}, "num_tangents must be a positive integer, got True"),
    ("fgd", {"tangent_checkpoint": "no"}, "fgd: tangent_checkpoint must be True or False, got 'no'"),
    ("asyncfgd", {"alpha": -0.5}, r"asyncfgd: alpha\[''\] = -0.5: must be in \[0, 1\]"),
    ("asyncfgd", {"intra_op_threads": True}, "asyncfgd: intra_op_threads must be a positive integer, got True"),
    ("asyncfgd", {"pin_workers": "yes"}, "asyncfgd: pin_workers must be True or False"),
])
def test_bad_method_options_are_refused_when_the_method_is_built(tiny_lora, method: str,
                                                                 options: dict[str, Any], message: str):
    with pytest.raises(EdgetrainError, match=message):
        edgetrain.Learner(tiny_lora(), method=method, probe=False, method_options=options)

