"""On-device transfer learning with AsyncFGD (the paper's §4.2 / §6.3 recipe) on real data.

A small convnet is pre-trained with backprop on the digits 0-4 (scikit-learn's 8x8 digits, the
"factory" model), then adapted on the device to a stream of the digits 5-9 with `asyncfgd`: the
network runs as K pipelined modules, only forward passes, and alpha scaling decides what learns --
the conv stages are frozen (alpha 0: no perturbation, JVPs pass through), the classifier head learns
fully (alpha 1) and the dense block is brought in gradually (alpha ramped from 0 to 0.15, as the
paper does for the layers before the classifier). Accuracy on held-out 5-9 digits and memory (what the
pipeline holds between steps; the process RSS, or the CUDA allocator's peak) are printed as the
stream goes, and at the end one step's tensor bytes next to backprop's.

Runs on CUDA when present (one CUDA stream per module, e.g. on a Jetson AGX Orin), else on the CPU
(one thread per module, each with one intra-op thread).

    python samples/orin_asyncfgd_transfer.py            # ~1 min on a laptop CPU
    python samples/orin_asyncfgd_transfer.py --quick    # a few seconds (what the test runs)
"""
from __future__ import annotations

import argparse
import sys

import torch

import edgetrain
import edgetrain.methods.asyncfgd  # noqa: F401  (registers asyncfgd)
from edgetrain.data import digits_stream, load_digits_split
from edgetrain.data.batch import Batch
from edgetrain.models import load_model
from edgetrain.probes.tensors import TensorAccountant

OLD_DIGITS = (0, 1, 2, 3, 4)
NEW_DIGITS = (5, 6, 7, 8, 9)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short run (a few seconds)")
    parser.add_argument("--modules", type=int, default=2, help="K, pipeline modules (default 2)")
    parser.add_argument("--pretrain-epochs", type=int, default=30)
    parser.add_argument("--adapt-epochs", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=8, help="stream batch size on the device")
    parser.add_argument("--lr", type=float, default=0.003)
    parser.add_argument("--dense-alpha", type=float, default=0.15, help="final alpha of the dense block")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    return parser


def test_accuracy(learner: edgetrain.Learner, classes: tuple[int, ...]) -> float:
    inputs, labels = load_digits_split("test", classes=classes, image=True)
    return learner.evaluate([Batch(inputs, labels)])["accuracy"]


def alpha_at(epoch: float, ramp_epochs: float, dense_alpha: float) -> dict[str, float]:
    """Conv stages frozen, head fully perturbed, the dense block ramped up linearly (paper App. I.1)."""
    return {"": 0.0, "blocks.2": dense_alpha * min(1.0, epoch / ramp_epochs), "head": 1.0}


def peak_step_bytes(model: torch.nn.Module, method: str, batch: Batch, method_options: dict) -> int:
    """Peak tensor bytes above weights of one step, by tensor accounting (one thread: the
    accounting sees only the thread it runs in, so the pipeline runs its reference scheduler)."""
    learner = edgetrain.Learner(model, method=method, lr=0.0, probe=False, backend=_backend(model),
                                method_options=method_options)
    for _ in range(method_options.get("num_modules", 1)):  # fill the pipeline first
        learner.step(batch)
    accountant = TensorAccountant(model)
    if method == "asyncfgd":
        accountant.register(*learner.method.in_flight_tensors())
    with accountant:
        learner.step(batch)
    return accountant.report().peak_above_baseline_bytes


def memory_label(device: str) -> str:
    return "cuda peak" if device == "cuda" else "process RSS"


def memory_now(device: str) -> str:
    """CUDA: the allocator's peak since the last report (all streams); CPU: the resident set size.
    (The learner's per-step probe is off: resetting the Linux high-water mark every step costs
    more than a step of this model.)"""
    if device == "cuda":
        peak = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        return f"{peak / 2**20:.1f} MiB"
    import psutil

    return f"{psutil.Process().memory_info().rss / 2**20:.0f} MiB"


def _backend(model: torch.nn.Module) -> str:
    return "torch-cuda" if next(model.parameters()).is_cuda else "torch-cpu"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.pretrain_epochs, args.adapt_epochs = 8, 6
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if device == "cpu":
        torch.set_num_threads(1)  # the pipeline's workers use one intra-op thread each; so does the rest
    backend = "torch-cuda" if device == "cuda" else "torch-cpu"
    print(f"device: {device}; pipeline modules: {args.modules}")

    # 1. The factory model: backprop on the digits 0-4.
    model = load_model("convnet-digits", device=device)
    pretrain = edgetrain.Learner(model, method="bp", backend=backend, optimizer="sgd", lr=0.1,
                                 optimizer_options={"momentum": 0.9}, probe=False)
    for batch in digits_stream("train", batch_size=32, classes=OLD_DIGITS, image=True,
                               epochs=args.pretrain_epochs, seed=0):
        pretrain.step(batch)
    print(f"pre-trained with bp on {OLD_DIGITS}: accuracy {test_accuracy(pretrain, OLD_DIGITS):.3f} on them, "
          f"{test_accuracy(pretrain, NEW_DIGITS):.3f} on {NEW_DIGITS}")

    # 2. On the device: a stream of new digits, forward passes only, K modules at once.
    stream = digits_stream("train", batch_size=args.batch_size, classes=NEW_DIGITS, image=True,
                           epochs=args.adapt_epochs, seed=1)
    steps_per_epoch = len(load_digits_split("train", classes=NEW_DIGITS)[1]) // args.batch_size
    ramp_epochs = max(1.0, args.adapt_epochs / 4)
    options = {"num_modules": args.modules, "alpha": alpha_at(0, ramp_epochs, args.dense_alpha), "seed": 0}
    learner = edgetrain.Learner(model, method="asyncfgd", backend=backend, optimizer="sgd", lr=args.lr,
                                method_options=options, probe=False)
    method = learner.method
    print(f"asyncfgd modules: {method.split}; staleness per module: {method.staleness}")
    print(f"{'step':>6} {'epoch':>6} {'loss':>7} {'acc 5-9':>8} {'acc 0-4':>8} {'in flight':>10} {memory_label(device):>12}"
          f"  alpha(dense)")
    report_every = max(1, steps_per_epoch * args.adapt_epochs // 8)
    try:
        for index, batch in enumerate(stream):
            epoch = index / steps_per_epoch
            if index % steps_per_epoch == 0:
                method.set_alpha(alpha_at(epoch, ramp_epochs, args.dense_alpha))
            stats = learner.step(batch)
            if stats.step % report_every == 0 or stats.step == 1:
                held = sum(t.numel() * t.element_size() for t in method.in_flight_tensors())
                print(f"{stats.step:>6} {epoch:>6.1f} {stats.loss:>7.3f} {test_accuracy(learner, NEW_DIGITS):>8.3f} "
                      f"{test_accuracy(learner, OLD_DIGITS):>8.3f} {held / 2**10:>6.1f} KiB {memory_now(device):>12}  "
                      f"{method.bank.alpha['blocks.2.layer.linear.weight']:.3f}", flush=True)
        final = test_accuracy(learner, NEW_DIGITS)
        print(f"adapted with asyncfgd: accuracy {final:.3f} on {NEW_DIGITS}")
    finally:
        method.close()

    # 3. What the step costs in memory, by tensor accounting, next to backprop on the same model.
    batch = next(iter(digits_stream("train", batch_size=args.batch_size, classes=NEW_DIGITS, image=True, seed=2)))
    batch = batch.to(device)
    frozen = {"alpha": alpha_at(ramp_epochs, ramp_epochs, args.dense_alpha)}
    bp_bytes = peak_step_bytes(model, "bp", batch, {})
    fgd_bytes = peak_step_bytes(model, "asyncfgd", batch,
                                {"num_modules": args.modules, "runtime": "reference", **frozen})
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"one step's tensors above the weights ({weights / 2**10:.0f} KiB): bp {bp_bytes / 2**10:.1f} KiB, "
          f"asyncfgd {fgd_bytes / 2**10:.1f} KiB ({fgd_bytes / max(bp_bytes, 1):.2f} of bp)")
    return 0 if final > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
