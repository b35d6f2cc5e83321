"""Server parity: the same SegProp / SCPL / subnetwork-DP run on one device and under torchrun.

Each method trains one small config on scikit-learn's digits twice -- in this process, and under
torchrun on localhost with gloo -- then compares the two runs: the largest |weight difference| after
the last step, the largest |loss difference| over the steps, and each run's held-out accuracy.

    segprop  2 ranks, DistributedDataParallel over the active path (edgetrain.recipes.ddp_segprop),
             each rank on half of every global batch; one process: run_schedule on the whole batch.
    scpl     2 workers, one per component, activations sent downstream (edgetrain.recipes.scpl_pipeline);
             one process: Learner(method="scpl", num_components=2), the components in turn.
    subnet   4 ranks, P = 2 owners per block (block masking), each rank holding only its subnetwork
             (edgetrain.recipes.subnet_dp.trainer.train_subnet_dp); one process: the `subnet_dp`
             simulation of the same 4 workers on the full model.

    python samples/server_parity.py                       # all three, longer runs
    python samples/server_parity.py --quick               # all three, a few seconds of training each
    python samples/server_parity.py --methods scpl,subnet --quick
    python samples/server_parity.py --methods subnet --steps 300 --subnet-noise-floor

Both runs of a method take the same updates; they differ only in the order floats are summed (a
gradient averaged over ranks instead of over one batch, a loss reduced across ranks), so the tolerance
below is about 800 float32 ulps of a weight of size 1: 1e-4 on weights and per-step losses, and the
two held-out accuracies must agree to within one test example (360 of them). The exit status is 1 if
any method is outside it. Every process runs one thread (OMP_NUM_THREADS=1), so the same kernels sum in
the same order inside a rank.

The subnet run is short (45 steps; quick 30) on purpose: this ResNet under SGD with Nesterov momentum
amplifies float rounding within ~60-150 steps on digits (at every lr and batch tried, 0.01-0.1 and
8-16 per worker), so past that horizon the two runs drift apart as far as the one-process run drifts
from itself when its weights are nudged by 1e-7. `--subnet-noise-floor` measures that drift next to
the torchrun comparison; `--steps 300` shows both.

This file is also the torchrun worker of the subnet comparison (`--worker subnet`): the CLI
(python -m edgetrain.recipes.subnet_dp.run) reports accuracies, not weights or per-step losses, so the
worker calls the same trainer with a step callback and gathers the unified model at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as `python samples/server_parity.py` from a checkout
    sys.path.insert(0, str(REPO))

METHODS = ("segprop", "scpl", "subnet")
WEIGHT_TOLERANCE = 1e-4
LOSS_TOLERANCE = 1e-4
TEST_EXAMPLES = 360  # digits' held-out split (20%, stratified)

# One config per method; --quick (or --steps) changes only the number of steps.
SEGPROP = {"resnet": {"in_channels": 1, "width": 8, "norm": "group", "blocks_per_stage": [1, 1, 1],
                      "num_classes": 10},
           "options": {"segments": 2, "head_blocks": 1, "snapcheck": True},
           "batch": 32, "lr": 0.1, "steps": {"quick": 25, "full": 150}}  # per stage
SCPL = {"options": {"projection_dims": [32, 32], "augment": {"flip": 0.0, "crop_scale": [0.7, 1.0]}},
        "batch": 32, "lr": 1e-3, "steps": {"quick": 40, "full": 400}}
SUBNET = {"workers": 4, "overlap": 2, "masking": "block", "batch": 8, "lr": 0.1, "momentum": 0.9,
          "blocks": [1, 1, 1, 1],
          "steps": {"quick": 30, "full": 45}}  # see the docstring: longer runs amplify rounding


@dataclass
class Parity:
    method: str
    launch: str
    steps: int
    max_weight_diff: float
    max_loss_diff: float
    single_accuracy: float
    distributed_accuracy: float
    seconds: float

    @property
    def ok(self) -> bool:
        return (self.max_weight_diff <= WEIGHT_TOLERANCE and self.max_loss_diff <= LOSS_TOLERANCE
                and abs(self.single_accuracy - self.distributed_accuracy) <= 1 / TEST_EXAMPLES + 1e-9)

    def line(self) -> str:
        return (f"{self.method}: {self.launch}, {self.steps} steps: max |weight diff| {self.max_weight_diff:.2e}, "
                f"max |loss diff| {self.max_loss_diff:.2e}, held-out accuracy {self.single_accuracy:.4f} "
                f"(one process) vs {self.distributed_accuracy:.4f} (torchrun), {self.seconds:.1f} s -- "
                f"{'PASS' if self.ok else 'FAIL'}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short runs: a check that everything runs and agrees")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, from {', '.join(METHODS)}")
    parser.add_argument("--steps", type=int, help="training steps of every run (SegProp: per stage); "
                                                  "default: the method's quick or full count")
    parser.add_argument("--subnet-noise-floor", action="store_true",
                        help="also rerun the one-process subnet run with its weights nudged by 1e-7 (relative) "
                             "after the first step: how far float rounding alone carries it")
    parser.add_argument("--timeout", type=float, default=600, help="seconds allowed for each torchrun launch")
    parser.add_argument("--worker", choices=["subnet"], help=argparse.SUPPRESS)  # torchrun worker mode
    parser.add_argument("--worker-config", help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    return parser


def parse_methods(text: str) -> list[str]:
    chosen = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in chosen if m not in METHODS]
    if unknown or not chosen:
        raise SystemExit(f"server_parity: unknown method(s) {', '.join(unknown) or '(none given)'}; "
                         f"choose from {', '.join(METHODS)}")
    return chosen


def max_weight_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    if set(a) != set(b):
        raise RuntimeError(f"the two runs hold different tensors: only one side has {sorted(set(a) ^ set(b))[:5]}")
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def max_loss_diff(a: list[float], b: list[float]) -> float:
    if len(a) != len(b):
        raise RuntimeError(f"the runs took a different number of steps: {len(a)} vs {len(b)}")
    return max(abs(x - y) for x, y in zip(a, b))


@torch.no_grad()
def accuracy(model: torch.nn.Module, image: bool) -> float:
    from edgetrain.data import load_digits_split

    features, labels = load_digits_split("test", image=image)
    was_training = model.training
    model.eval()
    correct = int((model(features).argmax(-1) == labels).sum())
    model.train(was_training)
    return correct / len(labels)


# -- SegProp: one process vs DDP ------------------------------------------------------------------

def segprop_parity(steps: int, timeout: float) -> Parity:
    """`steps` per stage (two stages, then the adapters are discarded)."""
    from safetensors.torch import load_file

    from edgetrain.data import make_stream
    from edgetrain.recipes import run_schedule
    from edgetrain.models.resnet import ResNetConfig, build_resnet

    cfg, started = SEGPROP, time.perf_counter()
    data = {"image": True, "shuffle": False}
    with tempfile.TemporaryDirectory(prefix="server-parity-") as tmp:
        out = Path(tmp) / "ddp.safetensors"
        argv = ["--method", "segprop", "--resnet", json.dumps(cfg["resnet"]), "--data", "digits",
                "--data-options", json.dumps(data), "--batch-size", str(cfg["batch"]),
                "--steps-per-stage", str(steps), "--optimizer", "sgd", "--lr", str(cfg["lr"]),
                "--method-options", json.dumps(cfg["options"]), "--backend", "gloo", "--out", str(out)]
        run_torchrun(2, "edgetrain.recipes.ddp_segprop", argv, timeout)
        distributed = load_file(out)
        report = json.loads(out.with_suffix(".json").read_text())

    model = build_resnet(ResNetConfig(**cfg["resnet"]))
    single = run_schedule(model, make_stream("digits", batch_size=cfg["batch"], **data), "segprop",
                          steps_per_stage=steps, optimizer="sgd", lr=cfg["lr"], **cfg["options"])
    other = build_resnet(ResNetConfig(**cfg["resnet"]))
    other.load_state_dict(distributed)
    return Parity("segprop", "2 gloo ranks (DDP) vs one process", single.steps,
                  max_weight_diff(model.state_dict(), distributed), max_loss_diff(single.losses, report["losses"]),
                  accuracy(model, image=True), accuracy(other, image=True), time.perf_counter() - started)


# -- SCPL: sequential components vs one worker per component ---------------------------------------

def scpl_parity(steps: int, timeout: float) -> Parity:
    import edgetrain
    from edgetrain.training.checkpoint import load_safetensors_checked
    from edgetrain.data import make_stream
    from edgetrain.recipes.scpl_pipeline import PipelineConfig, launch

    cfg, started = SCPL, time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="server-parity-") as tmp:
        path = Path(tmp) / "pipeline.safetensors"
        config = PipelineConfig(model="convnet-digits", method="scpl", method_options=cfg["options"], data="digits",
                                batch_size=cfg["batch"], steps=steps, optimizer="adam", lr=cfg["lr"], threads=1,
                                device="cpu", save=str(path))
        report = launch(config, 2, timeout=timeout)
        distributed, _ = load_safetensors_checked(path)

    learner = edgetrain.Learner(edgetrain.load_model("convnet-digits"), method="scpl", optimizer="adam",
                                lr=cfg["lr"], probe=False, method_options=dict(cfg["options"], num_components=2))
    losses: list[list[float]] = []
    for _, batch in zip(range(steps), make_stream("digits", batch_size=cfg["batch"])):
        learner.step(batch)
        losses.append(list(learner.method.last_losses))
    # Every worker's local loss at every step against the same component's in the sequential run.
    worst_loss = max(max_loss_diff([step[w["rank"]] for step in losses], w["losses"]) for w in report["workers"])
    single = learner.model.state_dict()  # includes the projection heads, as the pipeline saves them
    other = edgetrain.load_model("convnet-digits")
    missing, _ = other.load_state_dict({k: v for k, v in distributed.items() if k in other.state_dict()},
                                       strict=False)
    if missing:
        raise RuntimeError(f"the pipeline saved no weights for {missing[:5]}")
    return Parity("scpl", "2 gloo workers (one per component) vs sequential", steps,
                  max_weight_diff(single, distributed), worst_loss,
                  accuracy(learner.model, image=False), accuracy(other, image=False), time.perf_counter() - started)


# -- subnetwork DP: the single-process simulation vs N ranks holding their subnetworks ----------------

def subnet_setup(steps: int) -> tuple[Any, Any]:
    from edgetrain.recipes.subnet_dp.trainer import SubnetDPConfig
    from edgetrain.models.resnet_subnet import digits_subnet_config

    cfg = SUBNET
    config = SubnetDPConfig(masking=cfg["masking"], overlap=cfg["overlap"], batch_size=cfg["batch"], lr=cfg["lr"],
                            momentum=cfg["momentum"], nesterov=cfg["momentum"] > 0, max_steps=steps, epochs=1000.0)
    return digits_subnet_config(blocks_per_stage=tuple(cfg["blocks"])), config


def subnet_parity(steps: int, timeout: float) -> Parity:
    from edgetrain.recipes.subnet_dp.run import launch_local, load_data, save_data_file
    from edgetrain.recipes.subnet_dp.trainer import train_simulated

    cfg, started = SUBNET, time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="server-parity-") as tmp:
        data = save_data_file(Path(tmp) / "digits.pt", "digits")  # loaded once, not by every rank
        weights = Path(tmp) / "unified.pt"
        ranks = launch_local(cfg["workers"], ["--worker", "subnet", "--worker-config",
                                              json.dumps({"steps": steps, "data": str(data), "weights": str(weights)})],
                             module="samples.server_parity", timeout=timeout)
        distributed = torch.load(weights)
        train, test = load_data("digits", data_file=data)
    model_config, config = subnet_setup(steps)
    single = train_simulated(model_config, train, test, config, cfg["workers"])
    # The simulation's step loss is the mean of the N workers' losses; so is the ranks' mean.
    rank_mean = [sum(step) / len(step) for step in zip(*(r["losses"] for r in ranks))]
    return Parity("subnet", f"{cfg['workers']} gloo ranks (P={cfg['overlap']}, {cfg['masking']} masking) "
                            "vs single-process simulation", single["steps"],
                  max_weight_diff({k: v.detach() for k, v in single["model"].named_parameters()}, distributed),
                  max_loss_diff(single["losses"], rank_mean), single["test"]["accuracy"],
                  ranks[0]["test"]["accuracy"], time.perf_counter() - started)


def subnet_noise_floor(steps: int) -> tuple[float, float]:
    """The one-process subnet run twice, the second with every weight scaled by (1 + 1e-7 * N(0, 1))
    after its first step -- a perturbation of the size of float32 rounding. How far apart the two end
    up is how far rounding alone carries this run: the floor under any torchrun comparison."""
    from edgetrain.recipes.subnet_dp.run import load_data
    from edgetrain.recipes.subnet_dp.trainer import train_simulated

    train, _ = load_data("digits")
    model_config, config = subnet_setup(steps)
    plain = train_simulated(model_config, train, None, config, SUBNET["workers"])
    generator = torch.Generator().manual_seed(0)

    def nudge(step: int, model: torch.nn.Module, method: Any) -> None:
        if step == 0:
            with torch.no_grad():
                for param in model.parameters():
                    param.mul_(1 + 1e-7 * torch.randn(param.shape, generator=generator))

    nudged = train_simulated(model_config, train, None, config, SUBNET["workers"], on_step=nudge)
    weights = max_weight_diff({k: v.detach() for k, v in plain["model"].named_parameters()},
                              {k: v.detach() for k, v in nudged["model"].named_parameters()})
    return weights, max_loss_diff(plain["losses"], nudged["losses"])


def subnet_worker(args: argparse.Namespace) -> int:
    """One rank of the subnet run (under torchrun): train_subnet_dp, then rank 0 saves the unified model
    and writes every rank's per-step losses and test metrics to --json."""
    import torch.distributed as dist

    from edgetrain.recipes.subnet_dp.averaging import gather_full_state
    from edgetrain.recipes.subnet_dp.run import load_data
    from edgetrain.recipes.subnet_dp.trainer import train_subnet_dp

    spec = json.loads(args.worker_config)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        train, test = load_data("digits", data_file=Path(spec["data"]))
        model_config, config = subnet_setup(spec["steps"])
        losses: list[float] = []
        held: dict[str, Any] = {}

        def on_step(step: int, subnet: torch.nn.Module, loss: float) -> None:
            held["subnet"] = subnet
            losses.append(loss)

        result = train_subnet_dp(model_config, train, test, config, on_step=on_step)
        unified = gather_full_state(held["subnet"])  # a collective: every rank takes part
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, {"rank": result.rank, "losses": losses, "test": result.test})
        if dist.get_rank() == 0:
            torch.save({k: v.detach().cpu() for k, v in unified.items()}, spec["weights"])
            Path(args.json).write_text(json.dumps(everyone))
    finally:
        dist.destroy_process_group()
    return 0


# -- driver ------------------------------------------------------------------------------------------

def run_torchrun(num_workers: int, module: str, argv: list[str], timeout: float) -> None:
    from edgetrain.distributed import launch

    done = launch.run_torchrun(num_workers, module, argv, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"torchrun {module} with {num_workers} workers failed (exit {done.returncode}):\n"
                           f"{done.stderr[-4000:]}")


RUNNERS = {"segprop": segprop_parity, "scpl": scpl_parity, "subnet": subnet_parity}
CONFIGS = {"segprop": SEGPROP, "scpl": SCPL, "subnet": SUBNET}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker == "subnet":
        return subnet_worker(args)
    methods = parse_methods(args.methods)
    if args.steps is not None and args.steps < 1:
        raise SystemExit(f"server_parity: --steps must be at least 1, got {args.steps}")
    torch.set_num_threads(1)  # the same kernels and summation order as the one-thread ranks
    # launch_local's children must import this file as `samples.server_parity` wherever edgetrain lives.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))
    print(f"tolerance: |weight diff| <= {WEIGHT_TOLERANCE:g}, |loss diff| <= {LOSS_TOLERANCE:g}, "
          f"held-out accuracies within 1/{TEST_EXAMPLES}")
    results = []
    for method in methods:
        steps = args.steps or CONFIGS[method]["steps"]["quick" if args.quick else "full"]
        result = RUNNERS[method](steps, args.timeout)
        print(result.line(), flush=True)
        results.append(result)
        if method == "subnet" and args.subnet_noise_floor:
            weights, losses = subnet_noise_floor(steps)
            print(f"subnet noise floor: the one-process run against itself nudged by 1e-7, {steps} steps: "
                  f"max |weight diff| {weights:.2e}, max |loss diff| {losses:.2e}", flush=True)
    failed = [r.method for r in results if not r.ok]
    print("PASS" if not failed else f"FAIL: {', '.join(failed)}")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
