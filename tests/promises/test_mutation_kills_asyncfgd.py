"""Promises of AsyncFGD that mutation testing found unguarded (tools/mutation asyncfgd, docs/mutation.md):
each test here kills mutants of edgetrain/methods/asyncfgd/ that every other test let survive. Named
after the promise, not the mutant.

The methods are driven through their protocol (step(batch, optimizer)) on the float64 MLP, mostly with
the deterministic reference runtime; the worker tests use the thread runtime, and a step that could
hang (a worker that dies without reporting) runs under a time limit so that a hang fails the test."""
from __future__ import annotations

import copy
import os
import threading
from typing import Callable

import pytest
import torch
from torch import nn

import edgetrain.methods.asyncfgd  # noqa: F401  (registers asyncfgd)
from edgetrain.data.batch import Batch
from edgetrain.methods.asyncfgd import AsyncFGD, ThreadWorkers
from edgetrain.methods.base import NonFiniteError
from edgetrain.methods.fgd import ForwardGradient
from edgetrain.models.mlp import MLPConfig, build_mlp
from edgetrain.registry import EdgetrainError
from float64_mlp import feature_batches, mlp_float64

pytestmark = pytest.mark.usefixtures("one_thread")

LR = 0.05


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def unchanged(model: nn.Module, before: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(p, before[name]) for name, p in model.named_parameters())


def plain_sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR)


class CountingSGD(torch.optim.SGD):
    """torch's SGD, but not `torch.optim.SGD` itself: asyncfgd takes the general-optimizer path (the
    estimate goes to .grad and optimizer.step() applies it), and the steps are counted."""

    def __init__(self, params, lr: float) -> None:
        super().__init__(params, lr=lr)
        self.steps = 0

    def step(self, closure=None):  # type: ignore[override]
        self.steps += 1
        return super().step(closure)


def fail(message: str) -> Callable[..., None]:
    def raise_(*args, **kwargs) -> None:
        raise RuntimeError(message)
    return raise_


def raised_within(action: Callable[[], object], seconds: float = 10.0) -> BaseException | None:
    """Run `action` in a helper thread; the exception it raised (None if none). A pipeline whose worker
    died without reporting waits forever at a barrier: that fails here instead of hanging the suite."""
    outcome: list[BaseException | None] = []

    def target() -> None:
        try:
            action()
            outcome.append(None)
        except BaseException as error:  # noqa: BLE001 -- handed to the test
            outcome.append(error)

    helper = threading.Thread(target=target, daemon=True)
    helper.start()
    helper.join(seconds)
    assert not helper.is_alive(), "the step hung: a worker's error never reached the caller"
    return outcome[0]


# -- the fill steps ---------------------------------------------------------------------------------------

def test_only_the_fill_steps_pay_an_extra_whole_model_forward():
    # While the pipeline fills no sample leaves, so the entering batch's loss is computed by one extra
    # plain forward of the whole model; once the pipeline is full the leaving sample's loss comes for
    # free and a step costs exactly the K module forwards. The pipeline runs the units (embed, blocks,
    # head), never the model's own forward, so a hook on the model counts the extra forwards.
    model = mlp_float64((6, 5, 7))
    method = AsyncFGD(model, num_modules=3, runtime="reference")
    optimizer = plain_sgd(model)
    calls = []
    model.register_forward_hook(lambda *_: calls.append(method.steps_taken))
    for batch in feature_batches(6):
        method.step(batch, optimizer)
    assert calls == [0, 1]  # steps 0 .. K-2


def test_the_fill_loss_leaves_batchnorm_statistics_to_the_pipeline():
    # BatchNorm running statistics move once per sample, when the sample passes through the module
    # that holds the norm. The fill step's extra forward must put back what it moved: else the norm of
    # module 0 moves twice for the entering batch and module 1's norm moves for a batch it has not seen.
    model = build_mlp(MLPConfig(input_shape=(8,), hidden_sizes=(6, 5), num_classes=3, activation="tanh",
                                batch_norm=True, seed=0)).double()
    method = AsyncFGD(model, num_modules=2, runtime="reference")  # embed+blocks.0 | blocks.1+head
    first = copy.deepcopy(model.blocks[0])
    second = {name: b.clone() for name, b in model.blocks[1].named_buffers()}
    batch = feature_batches(1)[0]
    with torch.no_grad():
        first.train()(model.embed(batch.inputs))  # one training forward of module 0's norm
    method.step(batch, plain_sgd(model))
    for (name, buffer), expected in zip(model.blocks[0].named_buffers(), first.buffers()):
        torch.testing.assert_close(buffer, expected, rtol=1e-12, atol=0, msg=name)
    for name, buffer in model.blocks[1].named_buffers():
        assert torch.equal(buffer, second[name]), name


# -- tangents: never kept beyond their sample --------------------------------------------------------------

def test_a_failed_step_keeps_no_tangent_for_the_batch_that_did_not_enter(monkeypatch):
    # Without tangent checkpointing module 0 keeps the entering sample's tangents for its update. When
    # the step fails the batch has not entered (the step counter stays): its tangents must be dropped,
    # not held -- a parameter-sized tensor per parameter -- until some later step overwrites them.
    model = mlp_float64()
    method = AsyncFGD(model, num_modules=2, runtime="reference", num_tangents=2, tangent_checkpoint=False)
    optimizer = plain_sgd(model)
    batches = feature_batches(3)
    for batch in batches[:2]:
        method.step(batch, optimizer)
    kept, before = method.bank.kept_bytes(), weights(model)
    assert kept > 0  # module 0 holds sample 1's tangents

    stage = method.stages[0]
    real_forward = stage.forward

    def forward_then_fail(*args):
        real_forward(*args)  # the tangents are drawn (and kept); then the module fails
        raise RuntimeError("module 0 failed")

    monkeypatch.setattr(stage, "forward", forward_then_fail)
    with pytest.raises(RuntimeError, match="module 0 failed"):
        method.step(batches[2], optimizer)
    assert method.bank.kept_bytes() == kept
    assert unchanged(model, before) and method.steps_taken == 2


def _fail_in_module_then_retry(monkeypatch, runtime: str, steps: int, failing_step: int, failing_module: int) -> None:
    """Run `steps` batches with module `failing_module` failing once in step `failing_step`: the failed
    step keeps no tangent it drew and counts nothing, and the retry gives the uninterrupted run's weights."""
    def method_on(model):
        return AsyncFGD(model, num_modules=3, runtime=runtime, num_tangents=2, tangent_checkpoint=False)

    batches = feature_batches(steps)
    reference_model = mlp_float64()
    reference = method_on(reference_model)
    for batch in batches:
        reference.step(batch, plain_sgd(reference_model))
    model = mlp_float64()
    method = method_on(model)
    for batch in batches[:failing_step]:
        method.step(batch, plain_sgd(model))
    kept_before = method.bank.kept_bytes()
    stage = method.stages[failing_module]
    real_forward = stage.forward
    monkeypatch.setattr(stage, "forward", lambda *args: (real_forward(*args), fail("module failed")())[1])
    with pytest.raises(RuntimeError, match="module failed"):
        method.step(batches[failing_step], plain_sgd(model))
    assert method.bank.kept_bytes() == kept_before and method.steps_taken == failing_step
    monkeypatch.setattr(stage, "forward", real_forward)
    for batch in batches[failing_step:]:
        method.step(batch, plain_sgd(model))
    assert all(torch.equal(p, dict(reference_model.named_parameters())[n]) for n, p in model.named_parameters())


@pytest.mark.parametrize("runtime", ["reference", "threads"])
def test_a_failed_step_keeps_no_tangent_any_module_drew_in_it_and_the_retry_is_exact(monkeypatch, runtime):
    # Module k draws its tangents for sample t - k during step t. When the step fails nothing advances,
    # so what modules k >= 1 drew in it must go too (in_flight_tensors() would report them, and they
    # would sit in memory until the retry), and the retry must give the uninterrupted run's weights.
    _fail_in_module_then_retry(monkeypatch, runtime, steps=5, failing_step=3, failing_module=2)


@pytest.mark.parametrize("failing_step, failing_module", [(1, 1), (2, 2), (2, 1)])
def test_a_step_that_fails_while_the_pipeline_fills_keeps_no_tangent_drawn_for_the_first_sample(
        monkeypatch, failing_step, failing_module):
    # During the fill, module k first draws at step t = k, for sample 0: a failure there must drop those
    # tangents too (the release covers every k <= t, sample 0 included), and the retry is exact.
    _fail_in_module_then_retry(monkeypatch, "reference", steps=4, failing_step=failing_step,
                               failing_module=failing_module)


def test_a_sample_that_leaves_without_updating_keeps_no_tangent_behind():
    # A sample with a non-finite loss leaves the pipeline without updating any module; the tangents
    # the modules kept for it (tangent_checkpoint=False) are never taken by an update, so they must be
    # dropped when it leaves, or every bad sample would leak one set of parameter-sized tensors.
    model = mlp_float64()
    method = AsyncFGD(model, num_modules=2, runtime="reference", num_tangents=2, tangent_checkpoint=False)
    optimizer = plain_sgd(model)
    batches = feature_batches(4)
    method.step(batches[0], optimizer)
    steady = method.bank.kept_bytes()  # module 0 holds one sample's tangents between steps
    bad = batches[1]
    bad.inputs[0, 0] = float("nan")
    method.step(bad, optimizer)
    with pytest.raises(NonFiniteError, match="entered at step 1"):
        method.step(batches[2], optimizer)
    assert method.bank.kept_bytes() == steady
    method.step(batches[3], optimizer)
    assert method.bank.kept_bytes() == steady


def test_gradients_refuses_a_non_finite_directional_derivative_and_keeps_no_tangent(monkeypatch):
    # gradients() is the estimate at the current weights: a non-finite directional derivative is a
    # NonFiniteError (as in fgd and in step), not an estimate full of NaNs; and the tangents its forward
    # kept (tangent_checkpoint=False) are dropped, while the in-flight samples' ones stay.
    model = mlp_float64()
    method = AsyncFGD(model, num_modules=2, runtime="reference", num_tangents=2, tangent_checkpoint=False)
    optimizer = plain_sgd(model)
    batches = feature_batches(3)
    for batch in batches[:2]:
        method.step(batch, optimizer)
    kept, before = method.bank.kept_bytes(), weights(model)
    for stage in method.stages:
        real = stage.loss_derivatives
        monkeypatch.setattr(stage, "loss_derivatives",
                            lambda *args, real=real: (real(*args)[0], [float("nan")] * method.num_tangents))
    with pytest.raises(NonFiniteError, match="directional derivative"):
        method.gradients(batches[2])
    assert method.bank.kept_bytes() == kept
    assert unchanged(model, before) and method.steps_taken == 2


# -- general optimizers ----------------------------------------------------------------------------------

def test_a_general_optimizer_steps_once_per_leaving_sample_and_no_gradient_is_kept_between_steps():
    # With an optimizer other than plain SGD the estimate goes to .grad and the optimizer applies it:
    # exactly once per sample leaving the pipeline (never during the fill), giving the weights the
    # in-place plain-SGD update gives; and .grad is dropped afterwards (set to None, not zeroed), so
    # between steps no gradient-sized buffer is held -- the method's memory is inference memory.
    stream = feature_batches(5)
    general_model, in_place_model = mlp_float64(), mlp_float64()
    general = AsyncFGD(general_model, num_modules=2, runtime="reference", seed=3)
    in_place = AsyncFGD(in_place_model, num_modules=2, runtime="reference", seed=3)
    optimizer, sgd = CountingSGD(general_model.parameters(), lr=LR), plain_sgd(in_place_model)
    for t, batch in enumerate(stream):
        general.step(batch, optimizer)
        in_place.step(batch, sgd)
        assert optimizer.steps == t  # the fill step (t = 0) takes none
        assert all(p.grad is None for p in general_model.parameters())
    for name, param in general_model.named_parameters():
        expected = dict(in_place_model.named_parameters())[name]
        torch.testing.assert_close(param, expected, rtol=1e-10, atol=1e-12, msg=name)
    assert not unchanged(general_model, weights(mlp_float64()))


# -- resuming --------------------------------------------------------------------------------------------

def test_resuming_into_a_different_pipeline_is_refused():
    # The in-flight activations and the tangent keys belong to one pipeline (K modules, a split, a
    # number of tangents): loaded into another they would be fed to the wrong module or tangent.
    state = AsyncFGD(mlp_float64((6, 5, 7)), num_modules=2, runtime="reference").state_dict()
    for options in ({"num_modules": 3}, {"num_tangents": 2}, {"split": [1, 2]}):
        other = AsyncFGD(mlp_float64((6, 5, 7)), runtime="reference", **{"num_modules": 2, **options})
        with pytest.raises(EdgetrainError, match="resume with the same pipeline"):
            other.load_state_dict(state)


def test_a_resumed_run_draws_its_tangents_with_the_checkpoints_seed():
    # The seed is state: a run resumed into a method constructed with another seed (say the default)
    # must go on drawing the tangents of the checkpointed run, in every module.
    stream = feature_batches(6)
    straight_model = mlp_float64()
    straight = AsyncFGD(straight_model, num_modules=2, runtime="reference", seed=11)
    optimizer = plain_sgd(straight_model)
    for batch in stream:
        straight.step(batch, optimizer)

    first_model = mlp_float64()
    first = AsyncFGD(first_model, num_modules=2, runtime="reference", seed=11)
    optimizer = plain_sgd(first_model)
    for batch in stream[:3]:
        first.step(batch, optimizer)
    resumed_model = copy.deepcopy(first_model)
    resumed = AsyncFGD(resumed_model, num_modules=2, runtime="reference")  # seed 0
    resumed.load_state_dict(first.state_dict())
    optimizer = plain_sgd(resumed_model)
    for batch in stream[3:]:
        resumed.step(batch, optimizer)
    assert all(torch.equal(p, q) for p, q in zip(resumed_model.parameters(), straight_model.parameters()))


def test_a_resumed_run_without_tangent_checkpointing_keeps_exactly_the_uninterrupted_runs_tangents():
    # Without checkpointing the kept tangents are the memory this variant exists to measure: after a
    # resume each in-flight sample's tangents are kept again for exactly the modules it has passed
    # through, no more (a module that has not run the sample yet holds nothing for it).
    stream = feature_batches(4)
    model = mlp_float64((6, 5, 7))
    straight = AsyncFGD(model, num_modules=3, runtime="reference", num_tangents=2, tangent_checkpoint=False)
    optimizer = plain_sgd(model)
    for batch in stream:
        straight.step(batch, optimizer)
    resumed = AsyncFGD(copy.deepcopy(model), num_modules=3, runtime="reference", num_tangents=2,
                       tangent_checkpoint=False)
    resumed.load_state_dict(straight.state_dict())
    assert all(item is not None for item in resumed.in_flight)
    assert resumed.bank.kept_bytes() == straight.bank.kept_bytes()


# -- cutting the model into modules ----------------------------------------------------------------------

@pytest.mark.parametrize("num_modules", [0, -1, True, 2.0, "2"])
def test_num_modules_must_be_a_positive_integer(num_modules):
    # A bad K is refused by name, not turned into a ZeroDivisionError or silently read as K = 1 (True).
    with pytest.raises(EdgetrainError, match="num_modules must be a positive integer"):
        AsyncFGD(mlp_float64(), num_modules=num_modules, runtime="reference")


def test_a_model_without_a_block_view_trains_as_one_module_and_cannot_be_cut():
    # A model without embed/blocks/head is one unit: with K = 1 asyncfgd is fgd on it; any cut (K > 1,
    # or an explicit split) is refused -- never run with the model as two modules, or twice in a row.
    def square() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 8), nn.Tanh()).double()

    single_model, fgd_model = square(), square()
    single = AsyncFGD(single_model, num_modules=1, runtime="reference", seed=4)
    fgd = ForwardGradient(fgd_model, seed=4)
    single_optimizer, fgd_optimizer = plain_sgd(single_model), plain_sgd(fgd_model)
    for batch in feature_batches(3):
        single.step(batch, single_optimizer)
        fgd.step(batch, fgd_optimizer)
    assert all(torch.equal(p, q) for p, q in zip(single_model.parameters(), fgd_model.parameters()))
    assert not unchanged(single_model, weights(square()))
    for options in ({"num_modules": 2}, {"num_modules": 1, "split": [0]}):
        with pytest.raises(EdgetrainError, match="no block view"):
            AsyncFGD(square(), runtime="reference", **options)


def test_a_block_view_without_blocks_is_cut_into_embed_and_head():
    # An MLP with no hidden layer still has a block view (embed, no blocks, head): K = 1 keeps it whole,
    # K = 2 runs the embed and the head as modules of their own.
    for num_modules, split in ((1, "embed+head"), (2, "embed | head")):
        model = mlp_float64(())
        method = AsyncFGD(model, num_modules=num_modules, runtime="reference")
        assert method.split == split
        optimizer = plain_sgd(model)
        for batch in feature_batches(3):
            method.step(batch, optimizer)
        assert not torch.equal(model.head.weight, mlp_float64(()).head.weight)


def test_a_split_may_leave_a_module_without_blocks_but_never_counts_below_zero():
    # split gives blocks per module; 0 is a module of embed (or head) alone, as the default split makes
    # when K exceeds the block count. A negative count would slice the block list from its end and
    # silently give another split.
    model = mlp_float64((6, 5, 7))
    method = AsyncFGD(model, num_modules=2, split=[0, 3], runtime="reference")
    assert method.split == "embed | blocks.0+blocks.1+blocks.2+head"
    optimizer = plain_sgd(model)
    for batch in feature_batches(3):
        method.step(batch, optimizer)
    with pytest.raises(EdgetrainError, match=r"split \[-1, 4\] must give 2 block counts"):
        AsyncFGD(mlp_float64((6, 5, 7)), num_modules=2, split=[-1, 4], runtime="reference")


class _TiedAcrossBlocks(nn.Module):
    """embed, one block, head, with the head's weight tied to the block's."""
    task = "classify"

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(8, 5, dtype=torch.float64)
        self.blocks = nn.ModuleList([nn.Linear(5, 5, dtype=torch.float64)])
        self.head = nn.Linear(5, 5, dtype=torch.float64)
        self.head.weight = self.blocks[0].weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.blocks[0](torch.tanh(self.embed(x)))))


def test_a_weight_tied_across_two_modules_is_refused():
    # Each module updates its own weights with its own stale copy and its own tangent; a weight shared
    # by two modules would be perturbed by two tangents and updated twice per sample. One module holding
    # both uses is fine.
    with pytest.raises(EdgetrainError, match="tied weights"):
        AsyncFGD(_TiedAcrossBlocks(), num_modules=2, runtime="reference")
    AsyncFGD(_TiedAcrossBlocks(), num_modules=1, runtime="reference")


# -- the thread workers ----------------------------------------------------------------------------------

def worker_placement(model: nn.Module, method: AsyncFGD) -> dict[str, tuple[frozenset[int], int]]:
    """(CPU affinity, torch intra-op threads) seen by the worker running module 0 and the one running the
    last module, recorded from inside their forwards during two steps (the second one runs every module;
    the fill step's extra whole-model forward runs in the caller's thread and is not recorded)."""
    seen = {}

    def record(where: str):
        def hook(*_) -> None:
            if threading.current_thread().name.startswith("asyncfgd-worker-"):
                seen.setdefault(where, (frozenset(os.sched_getaffinity(0)), torch.get_num_threads()))
        return hook

    model.embed.register_forward_hook(record("first"))
    model.head.register_forward_hook(record("last"))
    optimizer = plain_sgd(model)
    try:
        for batch in feature_batches(2):
            method.step(batch, optimizer)
    finally:
        method.close()
    return seen


def can_pin_threads() -> bool:
    """At least two cores, and a thread may pin itself to one of them (a container may forbid it)."""
    if not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2:
        return False
    pinned = []

    def pin() -> None:
        try:
            core = max(os.sched_getaffinity(0))
            os.sched_setaffinity(0, {core})
            pinned.append(os.sched_getaffinity(0) == {core})
        except OSError:
            pinned.append(False)

    helper = threading.Thread(target=pin)
    helper.start()
    helper.join()
    return pinned == [True]


pinning = pytest.mark.skipif(not can_pin_threads(), reason="needs at least two cores and thread pinning")


@pinning
def test_thread_workers_run_one_intra_op_thread_each_pinned_to_their_own_core():
    # The point of the thread runtime on a small device: K modules working at once, one core each,
    # one intra-op thread each (the defaults of the runtime, used as is when a caller builds it).
    allowed = frozenset(os.sched_getaffinity(0))
    model = mlp_float64()
    method = AsyncFGD(model, num_modules=2, runtime="reference")
    method.runtime = ThreadWorkers(method.stages)
    seen = worker_placement(model, method)
    (first, first_threads), (last, last_threads) = seen["first"], seen["last"]
    assert len(first) == len(last) == 1 and first != last and first | last <= allowed
    assert first_threads == last_threads == 1


@pinning
def test_thread_workers_stay_on_the_cores_the_caller_may_use():
    # A caller restricted to some cores (taskset, a launcher's placement) keeps its workers there.
    allowed = sorted(os.sched_getaffinity(0))
    try:
        os.sched_setaffinity(0, {allowed[-1]})
        model = mlp_float64()
        seen = worker_placement(model, AsyncFGD(model, num_modules=2, runtime="threads"))
    finally:
        os.sched_setaffinity(0, set(allowed))
    assert seen["first"][0] == seen["last"][0] == {allowed[-1]}


@pinning
def test_unpinned_thread_workers_keep_the_callers_cores():
    allowed = frozenset(os.sched_getaffinity(0))
    model = mlp_float64()
    seen = worker_placement(model, AsyncFGD(model, num_modules=2, runtime="threads", pin_workers=False))
    assert seen["first"][0] == seen["last"][0] == allowed


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the cuda-streams runtime needs a CUDA device")
def test_cuda_stream_workers_issue_each_modules_kernels_on_its_own_stream():
    # The cuda-streams runtime exists so that the GPU can overlap the K modules: each worker issues its
    # module's kernels on its own stream. On the default stream the values would be the same, but the
    # modules would run one after another.
    model = mlp_float64().cuda()
    method = AsyncFGD(model, num_modules=2, runtime="cuda-streams")
    seen = {}

    def record(where: str):
        def hook(*_) -> None:
            if threading.current_thread().name.startswith("asyncfgd-worker-"):
                seen.setdefault(where, torch.cuda.current_stream())
        return hook

    model.embed.register_forward_hook(record("first"))
    model.head.register_forward_hook(record("last"))
    optimizer = plain_sgd(model)
    try:
        for batch in feature_batches(2):
            method.step(Batch(batch.inputs.cuda(), batch.targets.cuda(), batch.index), optimizer)
        torch.cuda.synchronize()
    finally:
        method.close()
    assert seen["first"] == method.runtime.streams[0] and seen["last"] == method.runtime.streams[1]


def test_thread_workers_refuse_a_non_positive_thread_count():
    # Refused up front: a worker whose torch.set_num_threads(0) fails would die before serving and
    # leave every step waiting for it.
    stages = AsyncFGD(mlp_float64(), num_modules=2, runtime="reference").stages
    with pytest.raises(EdgetrainError, match="intra_op_threads must be a positive integer"):
        ThreadWorkers(stages, intra_op_threads=0)


def test_worker_threads_never_keep_the_interpreter_alive():
    # A learner that is not closed (a script that ends, an app that exits on an error) must not hang
    # the interpreter at exit: Python waits for non-daemon threads before it runs the finalizer that
    # would stop them.
    method = AsyncFGD(mlp_float64(), num_modules=2, runtime="threads")
    try:
        workers = [t for t in threading.enumerate() if t.name.startswith("asyncfgd-worker-")]
        assert len(workers) >= 2 and all(t.daemon for t in workers)
    finally:
        method.close()


def test_an_error_in_a_workers_forward_reaches_the_caller_and_the_workers_serve_on(monkeypatch):
    # An exception inside a worker thread is the caller's exception (not a hang, not a silently lost
    # sample); no module is updated, the step is not counted, and the workers go on serving.
    model = mlp_float64()
    method = AsyncFGD(model, num_modules=2, runtime="threads")
    optimizer = plain_sgd(model)
    batches = feature_batches(3)
    try:
        method.step(batches[0], optimizer)
        before = weights(model)
        monkeypatch.setattr(method.stages[1], "forward", fail("module 1 failed"))
        error = raised_within(lambda: method.step(batches[1], optimizer))
        assert isinstance(error, RuntimeError) and "module 1 failed" in str(error)
        assert unchanged(model, before) and method.steps_taken == 1
        monkeypatch.undo()
        assert raised_within(lambda: method.step(batches[1], optimizer)) is None
        assert method.steps_taken == 2 and not unchanged(model, before)
    finally:
        method.close()


def test_an_error_while_a_worker_checks_its_update_reaches_the_caller_and_no_module_changes(monkeypatch):
    # With plain SGD every module checks its update before any writes (all or nothing); an error in one
    # module's check (not a refusal) must stop every module's write and reach the caller.
    model = mlp_float64()
    method = AsyncFGD(model, num_modules=2, runtime="threads")
    optimizer = plain_sgd(model)
    batches = feature_batches(2)
    try:
        method.step(batches[0], optimizer)
        before = weights(model)
        monkeypatch.setattr(method.stages[0], "check_update", fail("module 0 check failed"))
        error = raised_within(lambda: method.step(batches[1], optimizer))
        assert isinstance(error, RuntimeError) and "module 0 check failed" in str(error)
        assert unchanged(model, before) and method.steps_taken == 1
    finally:
        method.close()


def test_an_error_while_a_worker_writes_its_estimate_reaches_the_caller_and_no_weight_changes(monkeypatch):
    # With a general optimizer each worker puts its module's estimate in .grad and the optimizer steps
    # after the timestamp; when one module fails to, the caller gets the error and the optimizer does
    # not step on a partial estimate.
    model = mlp_float64()
    method = AsyncFGD(model, num_modules=2, runtime="threads")
    optimizer = CountingSGD(model.parameters(), lr=LR)
    batches = feature_batches(2)
    try:
        method.step(batches[0], optimizer)
        before = weights(model)
        monkeypatch.setattr(method.stages[1], "set_gradients", fail("module 1 estimate failed"))
        error = raised_within(lambda: method.step(batches[1], optimizer))
        assert isinstance(error, RuntimeError) and "module 1 estimate failed" in str(error)
        assert unchanged(model, before) and optimizer.steps == 0 and method.steps_taken == 1
    finally:
        method.close()
