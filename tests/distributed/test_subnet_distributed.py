"""subnet_dp across real processes: torchrun on localhost, gloo, OMP_NUM_THREADS=1 per child.

The default run launches two short jobs (about a minute together on two cores): the engine's
self-check with N = 4, P = 2 and the torchrun entry point with N = 2. The digits comparison with DP
(a few minutes) is marked slow."""
from __future__ import annotations

from pathlib import Path

import pytest

from edgetrain.recipes.subnet_dp.run import launch_local, save_data_file


WORKERS = str(Path(__file__).resolve().parent / "workers")


@pytest.fixture(scope="module")
def selfcheck():
    # Three steps per masking kind, then a P = N run next to torch DDP; every rank reports.
    # workers/subnet_selfcheck.py is a test program, not part of the package: the workers find it on PYTHONPATH.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", WORKERS)
        return launch_local(4, ["--overlap", "2", "--steps", "3", "--batch-size", "4"],
                            module="subnet_selfcheck", timeout=400)


@pytest.mark.parametrize("masking", ["block", "neuron"])
def test_shared_parameters_stay_identical_across_owners_after_every_step(selfcheck, masking):
    for rank in selfcheck:
        found = rank["maskings"][masking]
        assert found["owner_discrepancy_per_step"] == [0.0, 0.0, 0.0], (masking, found["rank"])
        # ... and the unified model is the single-process simulation of the same 4 workers
        assert max(found["simulation_gap_per_step"]) < 1e-5, found["simulation_gap_per_step"]


@pytest.mark.parametrize("masking", ["block", "neuron"])
def test_per_rank_parameter_and_optimizer_bytes_are_about_p_over_n(selfcheck, masking):
    ratios = []
    for rank in selfcheck:
        found = rank["maskings"][masking]
        assert found["worker_parameters"] == found["plan_worker_parameters"]
        held = found["state_bytes"]
        assert held["optimizer"] == held["parameters"] == 4 * found["worker_parameters"]  # fp32 + momentum
        mid = found["state_bytes_mid_step"]  # after the optimizer step, before zero_grad
        assert mid["gradients"] == mid["optimizer"] == mid["parameters"] == 4 * found["worker_parameters"]
        ratio, trunk = found["param_plus_optimizer_ratio"], found["replicated_fraction"]
        ratios.append(ratio)
        # the plan's share of the branches plus the replicated trunk (stem, head, shortcuts: 2.1-2.3% here)
        if masking == "neuron":  # P/N of every branch's channels
            assert 0.5 <= ratio <= 0.5 + trunk + 0.01
        else:  # whole blocks under the memory cap: 1.2 x the balance-first heaviest (0.51 of the branches)
            assert ratio == pytest.approx(found["branch_load"] * (1 - trunk) + trunk, abs=1e-6)
            assert ratio <= 1.2 * 0.51 + trunk
    assert sum(ratios) / len(ratios) == pytest.approx(0.5 + trunk / 2, abs=0.005)  # P/N on average


@pytest.mark.parametrize("masking", ["block", "neuron"])
def test_masked_average_divides_by_owner_count_with_a_worker_sending_zeros(selfcheck, masking):
    gaps = []
    for rank in selfcheck:
        check = rank["maskings"][masking]["divide_by_p"]
        assert check["groups_max_error"] < 1e-6 and check["dense_max_error"] < 1e-6, check
        gaps.append(check["groups_gap_to_nonzero_count"])
    assert max(gaps) > 0.5  # dividing by the workers that sent non-zeros would have been visibly wrong


@pytest.mark.parametrize("masking", ["block", "neuron"])
def test_group_engine_equals_dense_engine(selfcheck, masking):
    assert all(rank["maskings"][masking]["engines_max_diff"] < 1e-6 for rank in selfcheck)


def test_p_equal_n_matches_torch_ddp(selfcheck):
    for rank in selfcheck:
        ddp = rank["ddp"]
        assert ddp["steps"] == 4 and ddp["weights_moved_by"] > 1e-3
        assert ddp["max_weight_diff"] < 1e-6, ddp


def test_torchrun_entry_point(tmp_path):
    pytest.importorskip("sklearn")
    data = save_data_file(tmp_path / "digits.pt", "digits")
    results = launch_local(2, ["--data-file", str(data), "--masking", "neuron", "--overlap", "1", "--max-steps", "6",
                               "--check-sync", "1"], timeout=300)
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        assert r["num_workers"] == 2 and r["overlap"] == 1 and r["steps"] == 6
        assert r["max_owner_discrepancy"] == 0.0
        assert r["worker_parameters"] < 0.55 * r["full_parameters"]
        assert 0.0 <= r["test"]["accuracy"] <= 1.0 and "accuracy" in r["test_ensemble"]
    assert results[0]["plan_fingerprint"] == results[1]["plan_fingerprint"]
    assert results[0]["test"] == results[1]["test"]  # one unified model


@pytest.mark.slow
def test_digits_block_masking_at_half_overlap_is_within_1_5_points_of_dp(tmp_path):
    """N = 4 torchrun processes, batch 16 each (global 64), lr 0.05 cosine: DP for 10 epochs vs block
    masking P = 2 for 20 (FLOP-matched), default owners (memory cap 1.2x; only the last stage's two
    branches are held by no common worker). About 80 s on two cores; each launch is bounded by its
    timeout. The unified full model (what is evaluated) and the workers' softmax ensemble must end
    within 1.5 points of DP. Each worker's own subnetwork is weaker (measured 95.5% vs DP 98.6% in the
    one-process simulation of this run), asserted within 5."""
    pytest.importorskip("sklearn")
    data = save_data_file(tmp_path / "digits.pt", "digits")
    common = ["--data-file", str(data), "--epochs", "10", "--lr", "0.05", "--batch-size", "16"]
    dp = launch_local(4, [*common, "--masking", "block", "--overlap", "4"], timeout=600)
    bm = launch_local(4, [*common, "--masking", "block", "--overlap", "2"], timeout=900)
    dp_acc = dp[0]["test"]["accuracy"]
    unified = bm[0]["test"]["accuracy"]
    own = sum(r["test_subnetwork"]["accuracy"] for r in bm) / len(bm)
    ensemble = bm[0]["test_ensemble"]["accuracy"]
    print(f"digits: DP {dp_acc:.4f}; block masking P/N=0.5: unified {unified:.4f}, "
          f"branches x P/N {bm[0]['test_branch_scaled']['accuracy']:.4f}, subnetworks {own:.4f}, "
          f"ensemble {ensemble:.4f}")
    assert bm[0]["steps"] == 2 * dp[0]["steps"] == 2 * 10 * (1437 // 64)
    assert dp_acc > 0.95
    assert unified >= dp_acc - 0.015
    assert ensemble >= dp_acc - 0.015
    assert own >= dp_acc - 0.05


@pytest.mark.slow
def test_digits_block_masking_unified_model_is_within_1_5_points_of_dp_over_seeds():
    """The paper's N = 8 at P/N = 0.5 (the one-process simulation, which the self-check ties to the
    torchrun engine step by step), global batch 64, lr 0.05 cosine, DP 10 epochs vs block masking P = 4
    for 20 (FLOP-matched), default owners, seeds 0-2 (model init, data order and masks). DP itself
    moves by up to 2.5 points between seeds on this 360-image test set (one image is 0.28 points), so
    the criterion is on the mean over seeds; each seed is held to 3 points. With balance-first owners
    (the earlier default) the unified model was 9.5-25.4 points below DP on these seeds. About 80 s."""
    pytest.importorskip("sklearn")
    from statistics import fmean

    from edgetrain.recipes.subnet_dp.run import load_data
    from edgetrain.recipes.subnet_dp.trainer import SubnetDPConfig, train_simulated
    from edgetrain.models.resnet_subnet import digits_subnet_config

    train, test = load_data("digits")
    dp_accs, unified, ensembles = [], [], []
    for seed in range(3):
        common = {"masking": "block", "epochs": 10, "batch_size": 8, "lr": 0.05, "mask_seed": seed, "data_seed": seed}
        model = digits_subnet_config(seed=seed)
        dp = train_simulated(model, train, test, SubnetDPConfig(overlap=8, **common), 8)
        bm = train_simulated(model, train, test, SubnetDPConfig(overlap=4, **common), 8)
        assert bm["steps"] == 2 * dp["steps"] and bm["plan"].branches_apart() == [(6, 7)]
        dp_accs.append(dp["test"]["accuracy"])
        unified.append(bm["test"]["accuracy"])
        ensembles.append(bm["test_ensemble"]["accuracy"])
        print(f"seed {seed}: DP {dp_accs[-1]:.4f}; block masking P/N=0.5 unified {unified[-1]:.4f}, "
              f"subnetworks {bm['test_subnetwork']['accuracy']:.4f}, ensemble {ensembles[-1]:.4f}")
    assert min(dp_accs) > 0.95
    assert fmean(unified) >= fmean(dp_accs) - 0.015
    assert fmean(ensembles) >= fmean(dp_accs) - 0.015
    assert all(u >= d - 0.03 for u, d in zip(unified, dp_accs))
