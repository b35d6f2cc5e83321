"""Export a classifier head and train it in the native C++ runner, the way an app without Python would.

1. torch: train the 64-32-10 `mlp-digits` classifier on digits 0-4 only (the "factory" model);
2. export: freeze its features, export the head as an ExecuTorch training program (.pte), and write the
   user's stream (all ten digits) to a batch file;
3. device: `edgetrain_et_runner` (targets/executorch/runner.cpp, built with the top-level CMakeLists.txt)
   trains the head on that stream with SGD and saves the new head;
4. check: the runner's loss trajectory and weights equal the ExecuTorch Python runtime's on the same .pte
   and batches, and torch's; held-out accuracy on all ten digits before and after.

    python samples/export_head_cpp.py                    # builds the runner in build/native, 300 steps
    python samples/export_head_cpp.py --quick            # 40 steps (what the tests and ctest run)
    python samples/export_head_cpp.py --runner build/native/edgetrain_et_runner
"""
from __future__ import annotations

import argparse
import copy
import itertools
import json
import sys
from pathlib import Path

import torch

import edgetrain
from edgetrain.data import digits_stream
from edgetrain.export import (export_training, load_trainer, make_trainable, torch_sgd_trajectory,
                              write_batch_file)
from edgetrain.export.native import REPO, build_runner, run_runner

TOLERANCE = 1e-5


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="few steps: a check that everything runs")
    parser.add_argument("--steps", type=int, default=None, help="runner steps (default 300, quick 40)")
    parser.add_argument("--pretrain-steps", type=int, default=None, help="torch steps on digits 0-4")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.2)
    parser.add_argument("--runner", default=None, help="a built edgetrain_et_runner (default: build one)")
    parser.add_argument("--workdir", default="export_head_cpp", help="where the .pte, batches and weights go")
    return parser


def accuracy(model: torch.nn.Module) -> float:
    features, labels = edgetrain.data.load_digits_split("test")
    with torch.no_grad():
        return float((model(features).argmax(-1) == labels).float().mean())


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    steps = args.steps or (40 if args.quick else 300)
    pretrain_steps = args.pretrain_steps or (150 if args.quick else 400)
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)

    # 1. The factory model: every weight trained in torch, on digits 0-4 only.
    model = edgetrain.load_model("mlp-digits")
    factory = edgetrain.Learner(model, method="bp", optimizer="adam", lr=1e-2, probe=False)
    for batch in itertools.islice(digits_stream(batch_size=args.batch, classes=range(5)), pretrain_steps):
        factory.step(batch)
    print(f"factory model (digits 0-4 only): held-out accuracy on all ten digits {accuracy(model):.3f}")

    # 2. Export the head over the frozen features; the user's stream has all ten digits.
    make_trainable(model, "head")
    batches = list(itertools.islice(digits_stream(batch_size=args.batch, seed=1), steps))
    program = export_training(model, batches[0], "executorch", workdir / "head.pte")
    batch_file = write_batch_file(workdir / "batches.bin", batches)
    print(f"exported {program} ({sum(p.numel() for p in model.head.parameters())} trainable weights), "
          f"{steps} batches of {args.batch} in {batch_file}")

    # 3. Train in the native runner.
    binary = Path(args.runner) if args.runner else build_runner(REPO / "build" / "native")
    native = run_runner(binary, program, batch_file, args.lr, save=workdir / "head-trained.safetensors")
    print(f"native runner: loss {native.losses[0]:.4f} -> {native.losses[-1]:.4f} over {len(native.losses)} steps")

    # 4. The same .pte and batches in the ExecuTorch Python runtime, and the same steps in torch.
    trainer = load_trainer("executorch", program, args.lr, batches[0])
    python_losses = [trainer.step(batch) for batch in batches]
    torch_losses, torch_weights = torch_sgd_trajectory(copy.deepcopy(model), batches, args.lr)
    python_weights = trainer.parameters()
    report = {
        "max_loss_diff_vs_python_runtime": max(abs(a - b) for a, b in zip(native.losses, python_losses)),
        "max_weight_diff_vs_python_runtime": max(float((native.parameters[n] - w).abs().max())
                                                 for n, w in python_weights.items()),
        "max_loss_diff_vs_torch": max(abs(a - b) for a, b in zip(native.losses, torch_losses)),
        "max_weight_diff_vs_torch": max(float((native.parameters[n] - w).abs().max())
                                        for n, w in torch_weights.items()),
    }
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in native.parameters:
                param.copy_(native.parameters[name])
    print(f"after on-device training of the head: held-out accuracy on all ten digits {accuracy(model):.3f}")
    print(json.dumps({"steps": len(native.losses), **report}))
    ok = len(native.losses) == steps and max(report.values()) <= TOLERANCE
    if not ok:
        print("the native runner does not reproduce the Python runtime and torch", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
