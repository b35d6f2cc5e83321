"""Promises of the multi-process engine of subnetwork data parallelism that mutation testing found
unguarded (tools/mutation averaging_torchrun, docs/mutation.md): each test here kills mutants of
`_Piece`, `_Bucket`, `MaskedAverager` and `gather_full_state` in
edgetrain/recipes/subnet_dp/averaging.py that every other test let survive. Named after the promise,
not the mutant.

The engine runs for real: four forked processes in a gloo process group on a FileStore (no torchrun,
a few seconds), on the digits ResNet at width 4 with two stages of two blocks. Every rank holds one
worker's subnetwork, sets integer-valued gradients (so sums and the divisions by P = 1, 2, 4 and
N = 4 are exact in float32), averages them with both engines, reports `stats`, the discrepancy check
and the unified model; the test process judges against references computed here from the plan alone:
each entry's gradient is the sum over its owners divided by its owner count, the per-rank bytes are
those of the rank's own slices (a ring all-reduce per owner group), the unified model is the full
model the subnetworks were cut from."""
from __future__ import annotations

import multiprocessing
import time
from functools import lru_cache
from pathlib import Path

import pytest
import torch

from edgetrain.recipes.subnet_dp.config import layout_of
from edgetrain.methods.subnet_dp.assign import assign_masks
from edgetrain.methods.subnet_dp.layout import parameter_role
from edgetrain.methods.subnet_dp.subnetwork import materialise_subnetwork
from edgetrain.models.resnet_subnet import build_subnet_resnet, digits_subnet_config
from edgetrain.registry import EdgetrainError

WORLD = 4
CONFIG = digits_subnet_config(width=4, blocks_per_stage=(2, 2))
# (masking, P): the canonical cases, an owner set of one (P = 1: nothing to send) and P = N.
SCENARIOS = [("block", 2), ("neuron", 2), ("neuron", 1), ("block", 1), ("neuron", 4)]
MASK_SEED = 3
NO_GRAD = "head.fc.bias"  # rank 1 leaves this .grad None: autograd did not reach it, it still sends zeros


@lru_cache(maxsize=None)
def plan_of(masking: str, overlap: int):
    return assign_masks(layout_of(CONFIG), masking, WORLD, overlap, MASK_SEED)


@lru_cache(maxsize=None)
def full_model() -> dict[str, torch.Tensor]:
    return {name: p.detach() for name, p in build_subnet_resnet(CONFIG).named_parameters()}


def full_gradient(worker: int, name: str, shape) -> torch.Tensor:
    """Worker `worker`'s gradient of `name` in full coordinates: small integers, so every sum is exact."""
    generator = torch.Generator().manual_seed(1000 * worker + sum(map(ord, name)))
    return torch.randint(-8, 9, tuple(shape), generator=generator).float()


def ring(payload: int, members: int) -> int:
    return 0 if members <= 1 else int(2 * (members - 1) / members * payload)


# -- the child processes ------------------------------------------------------------------------------
def _child(rank: int, store: str, out: str) -> None:
    import torch.distributed as dist

    from edgetrain.recipes.subnet_dp.averaging import MaskedAverager, gather_full_state

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    found = {}
    try:
        for masking, overlap in SCENARIOS:
            plan = plan_of(masking, overlap)
            subnet = materialise_subnetwork(CONFIG, plan, rank)
            averager = MaskedAverager(subnet)
            result = {"stats_before": dict(averager.stats)}
            for engine in ("groups", "dense", "groups"):
                for name, p in subnet.named_parameters():
                    p.grad = subnet.from_full(name, full_gradient(rank, name, subnet.full_shapes[name])).clone()
                if rank == 1:
                    subnet.get_parameter(NO_GRAD).grad = None
                stats = averager.average(engine=engine)
                result.setdefault(engine, []).append({"stats": stats, "attribute": dict(averager.stats),
                                                      "grads": {n: p.grad.clone() for n, p in subnet.named_parameters()}})
            result["discrepancy_equal"] = averager.owner_discrepancy()
            # rank 0 moves one entry of a masked parameter (shared with P - 1 others), then one of the trunk
            params = dict(subnet.named_parameters())
            masked = next(name for name in params if parameter_role(name, plan.kind)[0] != "replicated")
            for case, name in (("masked", masked), ("trunk", "embed.conv.weight")):
                entry = params[name].data.view(-1)
                before = entry[0].item()
                if rank == 0:
                    entry[0] += 0.5
                result[f"discrepancy_{case}"] = averager.owner_discrepancy()
                entry[0] = before
            result["unified"] = gather_full_state(subnet)
            found[f"{masking}/{overlap}"] = result
    finally:
        torch.save(found, Path(out) / f"rank{rank}.pt")
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Every rank's findings for every scenario (one fork of WORLD processes for the whole module)."""
    where = tmp_path_factory.mktemp("averaging")
    for masking, overlap in SCENARIOS:  # the block owner search takes seconds: once, here, inherited by fork
        plan_of(masking, overlap)
    context = multiprocessing.get_context("fork")  # no re-import of torch per rank: ~1 s, not ~30 s
    processes = [context.Process(target=_child, args=(rank, str(where / "store"), str(where)), daemon=True)
                 for rank in range(WORLD)]
    for process in processes:
        process.start()
    deadline = time.monotonic() + 180
    for process in processes:
        process.join(timeout=max(0.0, deadline - time.monotonic()))
    hung = [rank for rank, process in enumerate(processes) if process.is_alive()]
    for rank in hung:
        processes[rank].kill()
        processes[rank].join()
    assert not hung, f"ranks {hung} did not finish (a collective that never matched)"
    assert [process.exitcode for process in processes] == [0] * WORLD
    return [torch.load(where / f"rank{rank}.pt") for rank in range(WORLD)]


# -- references from the plan alone ------------------------------------------------------------------
def reference_average(masking: str, overlap: int) -> dict[str, torch.Tensor]:
    """sum over the owners of each entry / its owner count, in full coordinates."""
    plan = plan_of(masking, overlap)
    out = {}
    for name, p in full_model().items():
        total = torch.zeros(p.shape)
        for worker in range(WORLD):
            grad = full_gradient(worker, name, p.shape)
            if worker == 1 and name == NO_GRAD:
                grad = torch.zeros(p.shape)
            total += grad * plan.parameter_mask(name, p.shape, worker).float()
        out[name] = total / plan.owner_count(name)
    return out


def expected_group_stats(masking: str, overlap: int, worker: int) -> dict[str, int]:
    """One all-reduce of the trunk among all N, one per owner set of more than one worker holding any of
    this worker's masked entries, each carrying exactly this worker's entries of that set (float32)."""
    plan = plan_of(masking, overlap)
    per_set: dict[object, int] = {}
    for name, p in full_model().items():
        role, block, dim = parameter_role(name, plan.kind)
        if role == "replicated":  # the trunk: its own all-reduce among all N
            owners_of_rows, per_row = ["trunk"], p.numel()
        elif role == "branch":
            owners_of_rows, per_row = [plan.block_owners[block]], p.numel()
        else:
            owners_of_rows = list(plan.channel_owners[block])
            per_row = p.numel() // p.shape[dim]
        for owners in owners_of_rows:
            if owners == "trunk" or worker in owners:
                per_set[owners] = per_set.get(owners, 0) + 4 * per_row
    members = {owners: WORLD if owners == "trunk" else len(owners) for owners in per_set}
    sent = {owners: size for owners, size in per_set.items() if members[owners] > 1}
    return {"payload_bytes": sum(sent.values()),
            "wire_bytes": sum(ring(size, members[owners]) for owners, size in sent.items()),
            "collectives": len(sent)}


def expected_dense_stats() -> dict[str, int]:
    sizes = [4 * p.numel() for p in full_model().values()]
    return {"payload_bytes": sum(sizes), "wire_bytes": sum(ring(size, WORLD) for size in sizes),
            "collectives": len(sizes)}


SCENARIO_IDS = [f"{m}-P{p}" for m, p in SCENARIOS]


# -- the promises -------------------------------------------------------------------------------------
@pytest.mark.parametrize("masking,overlap", SCENARIOS, ids=SCENARIO_IDS)
def test_each_entry_is_averaged_over_exactly_its_owners_by_both_engines(ranks, masking, overlap):
    plan = plan_of(masking, overlap)
    reference = reference_average(masking, overlap)
    for rank, found in enumerate(ranks):
        subnet = materialise_subnetwork(CONFIG, plan, rank)
        for engine in ("groups", "dense"):
            for run in found[f"{masking}/{overlap}"][engine]:
                assert set(run["grads"]) == {n for n, _ in subnet.named_parameters()}
                for name, grad in run["grads"].items():
                    assert torch.equal(grad, subnet.from_full(name, reference[name])), (engine, rank, name)


@pytest.mark.parametrize("masking,overlap", SCENARIOS, ids=SCENARIO_IDS)
def test_per_rank_bytes_are_those_of_the_ranks_own_slices_per_owner_group(ranks, masking, overlap):
    for rank, found in enumerate(ranks):
        expected = expected_group_stats(masking, overlap, rank)
        runs = found[f"{masking}/{overlap}"]["groups"]
        assert len(runs) == 2
        for run in runs:  # the same after a dense average in between: each average() counts afresh
            assert run["stats"] == expected, (rank, run["stats"], expected)
            assert run["attribute"] == expected
    if overlap > 1:  # "communicated bytes are exactly the owned fraction of DP's payload"
        for rank, found in enumerate(ranks):
            held = sum(p.numel() for p in materialise_subnetwork(CONFIG, plan_of(masking, overlap), rank).parameters())
            assert found[f"{masking}/{overlap}"]["groups"][0]["stats"]["payload_bytes"] == 4 * held


@pytest.mark.parametrize("masking,overlap", SCENARIOS, ids=SCENARIO_IDS)
def test_dense_engine_bytes_are_a_full_model_all_reduce_per_rank(ranks, masking, overlap):
    expected = expected_dense_stats()
    for found in ranks:
        run = found[f"{masking}/{overlap}"]["dense"][0]
        assert run["stats"] == expected and run["attribute"] == expected


@pytest.mark.parametrize("masking,overlap", SCENARIOS, ids=SCENARIO_IDS)
def test_a_new_averager_has_communicated_nothing(ranks, masking, overlap):
    for found in ranks:
        assert found[f"{masking}/{overlap}"]["stats_before"] == {"payload_bytes": 0, "wire_bytes": 0, "collectives": 0}


@pytest.mark.parametrize("masking,overlap", SCENARIOS, ids=SCENARIO_IDS)
def test_gather_full_state_is_the_unified_model_on_every_rank(ranks, masking, overlap):
    full = full_model()
    for found in ranks:
        unified = found[f"{masking}/{overlap}"]["unified"]
        assert set(unified) == set(full)
        for name, value in unified.items():
            assert torch.equal(value, full[name]), name
        assert found[f"{masking}/{overlap}"]["discrepancy_equal"] == 0.0


def _refusals_child(store: str, out: str) -> None:
    """A one-process group: which constructions and calls the averager refuses, and with what."""
    import torch.distributed as dist

    from edgetrain.recipes.subnet_dp.averaging import MaskedAverager

    torch.set_num_threads(1)
    found = {}

    def attempt(case, call):
        try:
            call()
            found[case] = None
        except Exception as error:  # noqa: BLE001  (the test judges the type)
            found[case] = (type(error), str(error))

    two = assign_masks(layout_of(CONFIG), "neuron", 2, 1, MASK_SEED)
    one = assign_masks(layout_of(CONFIG), "neuron", 1, 1, MASK_SEED)
    attempt("no process group", lambda: MaskedAverager(materialise_subnetwork(CONFIG, one, 0)))
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        # worker 0 of a plan for N = 2 in a world of one: the rank agrees, the world size does not
        attempt("plan for another N", lambda: MaskedAverager(materialise_subnetwork(CONFIG, two, 0)))
        attempt("unknown engine", lambda: MaskedAverager(materialise_subnetwork(CONFIG, one, 0), engine="ring"))
        averager = MaskedAverager(materialise_subnetwork(CONFIG, one, 0))
        attempt("unknown engine per call", lambda: averager.average(engine="ring"))
    finally:
        torch.save(found, Path(out) / "refusals.pt")
        dist.destroy_process_group()


def test_the_averager_refuses_a_plan_for_another_world_and_unknown_engines(tmp_path):
    process = multiprocessing.get_context("fork").Process(target=_refusals_child,
                                                          args=(str(tmp_path / "store"), str(tmp_path)), daemon=True)
    process.start()
    process.join(timeout=120)
    if process.is_alive():
        process.kill()
        process.join()
    assert process.exitcode == 0
    found = torch.load(tmp_path / "refusals.pt", weights_only=False)
    kind, message = found["plan for another N"]
    # Named edgetrain errors (docs/reliability.md), still the builtin kinds callers may catch.
    assert all(issubclass(found[case][0], EdgetrainError) for case in found)
    assert issubclass(kind, RuntimeError) and "rank 0 of 1 holds worker 0's subnetwork of a plan for 2 workers" in message
    kind, message = found["no process group"]
    assert issubclass(kind, RuntimeError) and "torch.distributed initialised" in message
    for case in ("unknown engine", "unknown engine per call"):
        kind, message = found[case]
        assert issubclass(kind, ValueError) and "unknown averaging engine 'ring'; known: groups, dense" in message


@pytest.mark.parametrize("masking,overlap", SCENARIOS, ids=SCENARIO_IDS)
def test_owner_discrepancy_reports_an_entry_one_owner_moved(ranks, masking, overlap):
    """0 while owners agree; the moved amount on every rank when one owner moves a shared entry; an entry
    nobody else holds (P = 1) cannot disagree."""
    for found in ranks:
        result = found[f"{masking}/{overlap}"]
        assert result["discrepancy_equal"] == 0.0
        assert result["discrepancy_trunk"] == pytest.approx(0.5, abs=1e-6)
        if overlap > 1:
            assert result["discrepancy_masked"] == pytest.approx(0.5, abs=1e-6)
        else:
            assert result["discrepancy_masked"] == 0.0
