"""subnet_dp across real processes: torchrun on localhost, gloo, OMP_NUM_THREADS=1 per child.

The default run launches two short jobs (about a minute together on two cores): the engine's
self-check with N = 4, P = 2 and the torchrun entry point with N = 2. The digits comparison with DP
(a few minutes) is marked slow."""
from __future__ import annotations

import pytest

from edgetrain.distributed.subnet.run import launch_local, save_data_file



@pytest.fixture(scope="module")
def selfcheck():
    # Three steps per masking kind, then a P = N run next to torch DDP; every rank reports.
    return launch_local(4, ["--overlap", "2", "--steps", "3", "--batch-size", "4"],
                        module="edgetrain.distributed.subnet.selfcheck", timeout=400)


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
        ratios.append(found["param_plus_optimizer_ratio"])
        # P/N = 0.5, plus the replicated trunk (stem, head, shortcuts: 2.1-2.3% here) and block granularity
        assert 0.5 <= found["param_plus_optimizer_ratio"] <= 0.5 + found["replicated_fraction"] + 0.01
    assert sum(ratios) / len(ratios) < 0.53


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
    masking P = 2 for 20 (FLOP-matched). About 80 s on two busy cores; each launch is bounded by its
    timeout. Within 1.5 points of DP (asserted): the workers' own subnetworks (mean) and their softmax
    ensemble. The unified full model (every branch at once, a combination no worker trained) is not:
    measured 81.6% vs DP 98.1% (95.3% with stochastic depth's test rule, branches x P/N). Those two
    are asserted only to stay within 25 / 5 points, so a regression in the unified model still fails."""
    pytest.importorskip("sklearn")
    data = save_data_file(tmp_path / "digits.pt", "digits")
    common = ["--data-file", str(data), "--epochs", "10", "--lr", "0.05", "--batch-size", "16"]
    dp = launch_local(4, [*common, "--masking", "block", "--overlap", "4"], timeout=600)
    bm = launch_local(4, [*common, "--masking", "block", "--overlap", "2"], timeout=900)
    dp_acc = dp[0]["test"]["accuracy"]
    unified = bm[0]["test"]["accuracy"]
    scaled = bm[0]["test_branch_scaled"]["accuracy"]
    own = sum(r["test_subnetwork"]["accuracy"] for r in bm) / len(bm)
    ensemble = bm[0]["test_ensemble"]["accuracy"]
    print(f"digits: DP {dp_acc:.4f}; block masking P/N=0.5: unified {unified:.4f}, "
          f"branches x P/N {scaled:.4f}, subnetworks {own:.4f}, ensemble {ensemble:.4f}")
    assert bm[0]["steps"] == 2 * dp[0]["steps"] == 2 * 10 * (1437 // 64)
    assert dp_acc > 0.95
    assert own >= dp_acc - 0.015
    assert ensemble >= dp_acc - 0.015
    assert scaled >= dp_acc - 0.05
    assert unified >= dp_acc - 0.25


@pytest.mark.slow
def test_digits_block_masking_with_mixed_owners_keeps_the_unified_model_near_dp():
    """The unified model itself at P/N = 0.5, N = 8 (the simulation, which the self-check ties to the
    torchrun engine step by step), global batch 64, lr 0.05 cosine, DP 10 epochs vs block masking P = 4
    for 20 (FLOP-matched), with mixing owners (load_slack 0.35). With the balanced default the first
    four branches and block 4 never share an owner, and the unified model measured 73.5% vs DP 98.9%
    on this seed; mixed, 97.5%. Over seeds 0-4 the mixed unified model was 0.0-3.1 points below DP
    (the balanced one 7.8-17.0), so this asserts 4 points, not 1.5. About a minute on two cores."""
    pytest.importorskip("sklearn")
    from edgetrain.distributed.subnet.run import load_data
    from edgetrain.distributed.subnet.trainer import SubnetDPConfig, train_simulated
    from edgetrain.models.resnet_subnet import digits_subnet_config

    train, test = load_data("digits")
    common = {"masking": "block", "epochs": 10, "batch_size": 8, "lr": 0.05}
    dp = train_simulated(digits_subnet_config(), train, test, SubnetDPConfig(overlap=8, **common), 8)
    bm = train_simulated(digits_subnet_config(), train, test, SubnetDPConfig(overlap=4, load_slack=0.35, **common), 8)
    assert bm["steps"] == 2 * dp["steps"]
    dp_acc, unified = dp["test"]["accuracy"], bm["test"]["accuracy"]
    own, ensemble = bm["test_subnetwork"]["accuracy"], bm["test_ensemble"]["accuracy"]
    print(f"digits N=8: DP {dp_acc:.4f}; block masking P/N=0.5, load_slack 0.35: unified {unified:.4f}, "
          f"subnetworks {own:.4f}, ensemble {ensemble:.4f}")
    assert dp_acc > 0.95
    assert unified >= dp_acc - 0.04
    assert ensemble >= dp_acc - 0.015
    # the price of mixing: each worker's own subnetwork is a little weaker (96.6% here vs 98.1% balanced)
    assert own >= dp_acc - 0.04
