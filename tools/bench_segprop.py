#!/usr/bin/env python3
"""SegProp next to end-to-end backprop (`bp`) and layer-wise training (`lw`), one run each.

  memory    peak training memory of ResNet-18 (ImageNet stem, 224x224, AdamW) by tensor accounting
            (edgetrain.probes.TensorAccountant: weights, grads, optimizer state and every activation
            alive at the step's peak) for bp and SegProp seg=2,3,4 with a global head of 3 blocks, the
            paper's Table 1 layout, and seg=4 with the paper's ResNet-18 split (appendix B.2: the
            `resnet-paper` view, GH = layer4[1]'s last conv + BN + the classifier); a SegProp cell is
            the largest stage. Without and with activation checkpointing (bp with checkpointing is
            `mebp`). SegProp runs with head_grads_last (--head-grads-last off: without), and with
            spill_waiting as --spill-waiting says (default off); one more row gives the paper's split with
            spill_waiting on (the weights of segments whose stage has not begun mapped from a file).
  snapcheck step time of SegProp's last stage (seg=4, GH=3: the deepest frozen prefix) on a stream in a
            fixed order, with SnapCheck (every batch after the first epoch is a cache hit) and without.
            (memory and snapcheck: arms of edgetrain.profiler.bench -- interleaved rounds, median, ratios)
  flops     FLOPs per sample of e2e vs each SegProp stage (the paper's Table 5 accounting: a training
            layer 3x its forward, 4x with checkpointing; a frozen one 1x; 0 when SnapCheck serves it)
            for ResNet-18 and for a 20-layer decoder (3 body segments + GH 4, checkpointing on, as §4.6).
  digits    the accuracy test in miniature, over several seeds: bp / lw / segprop on scikit-learn digits
            with a small ResNet (tests/methods/test_segprop_digits.py's recipe).
  fashion   the same comparison with ResNet-18 on Fashion-MNIST (Debian dataset-fashion-mnist; skipped
            with a message when it is not installed). Long on a CPU: --fashion-train N limits the data.

Usage:
  .venv/bin/python tools/bench_segprop.py                    # memory, snapcheck, flops, digits
  .venv/bin/python tools/bench_segprop.py --only memory --batch 16 --size 224 --png memory.png
  .venv/bin/python tools/bench_segprop.py --only fashion --fashion-epochs 2
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import edgetrain  # noqa: E402
from edgetrain.training.checkpoint import atomic_write_json  # noqa: E402
from edgetrain.data.batch import Batch  # noqa: E402
from edgetrain.recipes import run_schedule  # noqa: E402
from edgetrain.methods.segprop.flops import schedule_flops  # noqa: E402
from edgetrain.models.llama import LlamaConfig, LlamaModel  # noqa: E402
from edgetrain.models.resnet import ResNetConfig, build_resnet, resnet18_imagenet_config  # noqa: E402
from edgetrain.probes.tensors import TensorAccountant  # noqa: E402
from edgetrain.profiler.bench import (Arm, Column, format_table, measure_interleaved, ratios,  # noqa: E402
                                      summarise, write_json, write_png)
from edgetrain.utils.progress import progress_bar  # noqa: E402

MIB = 2**20
SECTIONS = ("memory", "snapcheck", "flops", "digits", "fashion")
TIME_COLUMNS = [Column("seconds", "step", 1.0, "s"), Column("steps_per_s", "speed", 1.0, "steps/s")]
COMPARISONS: list[tuple[dict, str, dict, str, Column]] = []  # (summaries, baseline, samples, title, chart column)


def compare(title: str, arms: list[Arm], baseline: str, columns: list[Column], repeats: int, warmup: int) -> dict:
    """The arms in interleaved rounds; prints their table and keeps it for --json / --png."""
    samples = measure_interleaved(arms, repeats=repeats, warmup=warmup, description=title.split(",")[0])
    summaries = {a: summarise([{c.metric: s.get(c.metric) for c in columns} for s in t]) for a, t in samples.items()}
    print("\n" + format_table(title, summaries, baseline, columns), flush=True)
    COMPARISONS.append((summaries, baseline, samples, title, columns[-1]))
    return summaries


class MLPHead(nn.Module):
    """The paper's classifier (appendix B.2.2): GAP, Linear C -> hidden, ReLU, Linear hidden -> classes."""

    def __init__(self, channels: int, hidden: int, classes: int) -> None:
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Linear(channels, hidden)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(self.pool(h).flatten(1))))


def resnet18(in_channels: int = 3, classes: int = 1000) -> nn.Module:
    return build_resnet(resnet18_imagenet_config(in_channels=in_channels, num_classes=classes))


def images(batch_size: int, size: int, seed: int = 0, channels: int = 3, classes: int = 1000) -> Batch:
    generator = torch.Generator().manual_seed(seed)
    return Batch(torch.rand(batch_size, channels, size, size, generator=generator),
                 torch.randint(0, classes, (batch_size,), generator=generator), seed)


# -- memory ----------------------------------------------------------------------------------------------

def measured_step(learner: edgetrain.Learner, batch: Batch) -> dict[str, int]:
    """Tensor bytes of one steady-state step (the optimizer state exists: one step ran before)."""
    learner.step(batch)
    model = learner.model
    accountant = TensorAccountant(model)
    accountant.register(learner.optimizer, batch.inputs, batch.targets)
    with accountant:
        learner.method.step(batch, learner.optimizer)
    weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    report = accountant.report()
    return {"weights": weights, "total": report.peak_bytes, "label": report.peak_label}


# Named splits of the memory table: (view, head blocks, balance). "paper" is appendix B.2's ResNet-18 split
# (with segments=4: stem + layer1 | layer2 | layer3 | layer4[0] + layer4[1]'s front; GH = its back + head).
SPLITS = {"blocks": ("blocks", 3, "blocks"), "memory": ("blocks", 3, "memory"), "paper": ("resnet-paper", 1, "blocks")}


def segprop_peaks(segments: int, split_name: str, checkpoint: bool, head_grads_last: bool, batch: Batch,
                  spill_waiting: bool = False) -> dict:
    view, head_blocks, balance = SPLITS[split_name]
    peaks, split = [], ()
    for stage in range(segments):
        learner = edgetrain.Learner(resnet18(), method="segprop", optimizer="adamw", lr=1e-4, probe=False,
                                    method_options={"view": view, "head_blocks": head_blocks, "segments": segments,
                                                    "checkpoint": checkpoint, "balance": balance,
                                                    "head_grads_last": head_grads_last,
                                                    "spill_waiting": spill_waiting,
                                                    "example_input": batch.inputs[:2].clone()})
        split = learner.method.plan.split
        for _ in range(stage):
            learner.method.advance_stage()
        peaks.append(measured_step(learner, batch))
        learner.method.finish()
    return {**max(peaks, key=lambda peak: peak["total"]), "split": "/".join(map(str, split)),
            "stages": [peak["total"] for peak in peaks], "head_blocks": head_blocks}


def memory(args: argparse.Namespace) -> None:
    """One comparison per checkpointing setting, one round (tensor accounting is deterministic)."""
    batch, plain = images(args.batch, args.size), None
    last, spill = args.head_grads_last == "on", args.spill_waiting == "on"
    # The paper's split once more with the waiting segments' weights spilled (unless every arm spills).
    extra = [("paper", True)] if "paper" in args.balance and not spill else []
    for checkpoint in [c == "on" for c in args.checkpointing]:
        arms = [Arm("bp", lambda c=checkpoint: measured_step(edgetrain.Learner(
            resnet18(), method="mebp" if c else "bp", optimizer="adamw", lr=1e-4, probe=False), batch))] + [
            Arm(f"seg={segments}" + (f", {name}" if name != "blocks" else "") + (", spill_waiting" if s else ""),
                lambda s=s, g=segments, n=name, c=checkpoint: segprop_peaks(g, n, c, last, batch, s))
            for name, s in [(n, spill) for n in args.balance] + extra
            for segments in ((4,) if name == "paper" else (2, 3, 4))]
        summaries = compare(f"Peak training memory, ResNet-18 (ImageNet stem) {args.size}x{args.size}, batch "
                            f"{args.batch}, AdamW, checkpointing {'on (bp: mebp)' if checkpoint else 'off'}",
                            arms, "bp", [Column("total", "peak", MIB, "MiB")], 1, 0)
        samples = COMPARISONS[-1][2]
        for arm, (sample, *_) in list(samples.items())[1:]:
            print(f"  {arm} (GH={sample['head_blocks']}, its largest stage): split {sample['split']}, per stage [" + ", ".join(
                f"{b / MIB:,.0f}" for b in sample["stages"]) + f"] MiB, peak in {sample['label']}")
        plain = plain if checkpoint else summaries["bp"]["total"].median
        if checkpoint and plain:
            print("  vs bp without checkpointing: " + ", ".join(
                f"{arm} {by['total'].median / plain:.2f}x" for arm, by in summaries.items()))
    print(f"(weights + buffers: {samples['bp'][0]['weights'] / MIB:,.0f} MiB of every cell; split = blocks per body "
          "segment, the first with the stem, 0 = the stem alone; 'memory' = balance='memory'; 'paper' = the "
          "resnet-paper view, GH = layer4[1]'s last conv + BN + classifier (appendix B.2). The paper's ResNet-101 "
          "Table 1 without checkpointing: 1.00 / 0.76 / 0.68 / 0.65)")


# -- SnapCheck ---------------------------------------------------------------------------------------------

class FixedBatches:
    """A stream of `count` fixed batches repeated for ever (batch id = index % count)."""

    def __init__(self, batches: list[Batch]) -> None:
        self.batches = batches
        self.batches_per_epoch = len(batches)
        self.shuffle = False

    def __iter__(self):
        index = 0
        while True:
            batch = self.batches[index % len(self.batches)]
            yield Batch(batch.inputs, batch.targets, index)
            index += 1


def snapcheck(args: argparse.Namespace) -> None:
    """Both learners step in interleaved rounds; the first epoch (it fills the cache) is the warm-up."""
    batches = [images(args.batch, args.size, seed=i) for i in range(args.snap_batches)]
    learners = {}
    for cached in (False, True):
        learner = edgetrain.Learner(resnet18(), method="segprop", optimizer="adamw", lr=1e-4, probe=False,
                                    method_options={"head_blocks": 3, "segments": 4, "snapcheck": cached,
                                                    "snapcheck_period": len(batches), "snapcheck_budget": "4GiB"})
        for _ in range(learner.method.num_stages - 1):
            learner.method.advance_stage()
        learners[cached] = (learner, iter(FixedBatches(batches)))

    def step(cached: bool) -> dict:
        seconds = learners[cached][0].step(next(learners[cached][1])).seconds
        return {"seconds": seconds, "steps_per_s": 1 / seconds}
    compare(f"SnapCheck, ResNet-18 {args.size}x{args.size} batch {args.batch}, last stage of seg=4, GH=3 (frozen: stem "
            f"+ blocks 0-3), {len(batches)} batches in a fixed order, {args.snap_epochs} epochs after the first",
            [Arm("without SnapCheck", lambda: step(False)), Arm("with SnapCheck", lambda: step(True))],
            "without SnapCheck", TIME_COLUMNS, repeats=len(batches) * args.snap_epochs, warmup=len(batches))
    print(f"  SnapCheck {learners[True][0].method.snapcheck.stats()}")
    for learner, _ in learners.values():
        learner.method.finish()


# -- FLOPs -------------------------------------------------------------------------------------------------

def flops_table(title: str, build, inputs: torch.Tensor, plans: list[dict], checkpointing: bool) -> dict:
    print(f"\n{title} (GFLOPs per sample; x = ratio to one e2e pass; "
          f"{'checkpointing: training 4x forward' if checkpointing else 'training 3x forward'}, frozen 1x)")
    print(f"{'':<4}{'stage':<30}{'active fwd':>11}{'frozen fwd':>11}{'total':>10}{'x e2e':>7}"
          f"{'SnapCheck':>11}{'x e2e':>7}")
    out = {}
    for options in plans:
        model = build()
        method = edgetrain.methods.METHODS.get("segprop")(model, **options)
        e2e, stages = schedule_flops(method, inputs, checkpointing=checkpointing)
        name = ", ".join(f"{k}={v}" for k, v in options.items())
        print(f"  {name} (split {'/'.join(map(str, method.plan.split))})")
        print(f"{'':<4}{'e2e (1 pass)':<30}{'':>11}{'':>11}{e2e / 1e9:>10.2f}{1.0:>7.2f}")
        for index, stage in enumerate(stages):
            print(f"{'':<4}{f'stage {index}: {stage.name}':<30}{stage.active_forward / 1e9:>11.2f}"
                  f"{stage.frozen_forward / 1e9:>11.2f}{stage.total / 1e9:>10.2f}{stage.total / e2e:>7.2f}"
                  f"{stage.total_snapcheck / 1e9:>11.2f}{stage.total_snapcheck / e2e:>7.2f}")
        total = sum(s.total for s in stages)
        cached = sum(s.total_snapcheck for s in stages)
        print(f"{'':<4}{'all stages':<30}{'':>22}{total / 1e9:>10.2f}{total / e2e:>7.2f}{cached / 1e9:>11.2f}"
              f"{cached / e2e:>7.2f}")
        out[name] = {"e2e": e2e, "stages": [s.total for s in stages], "total": total, "snapcheck_total": cached}
        method.finish()
    return out


def flops(args: argparse.Namespace) -> dict:
    resnet = flops_table("FLOPs per sample, ResNet-18 224x224", resnet18, torch.rand(2, 3, 224, 224),
                         [{"head_blocks": 3, "segments": s} for s in (2, 3, 4)], checkpointing=False)
    config = LlamaConfig(vocab_size=32000, hidden_size=256, intermediate_size=896, num_hidden_layers=20,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096)
    decoder = flops_table("FLOPs per sequence of 512 tokens, 20-layer decoder (d=256, V=32000)",
                          lambda: LlamaModel(config), torch.randint(0, 32000, (1, 512)),
                          [{"head_blocks": 4, "segments": 3}], checkpointing=True)
    return {"resnet18": resnet, "decoder": decoder}


# -- accuracy ----------------------------------------------------------------------------------------------

def digits(args: argparse.Namespace) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "methods"))
    from test_segprop_digits import RECIPE, train_digits

    results = {m: [] for m in ("bp", "lw", "segprop")}
    with progress_bar(args.seeds * len(results), description="digits", unit="run") as bar:
        for seed in range(args.seeds):
            for method in results:
                results[method].append(train_digits(method, seed=seed))
                bar.update()
    print(f"\nDigits test accuracy ({RECIPE}), {args.seeds} seeds:")
    print(f"{'method':<10}" + "".join(f"{'seed ' + str(s):>9}" for s in range(args.seeds)) + f"{'mean':>9}")
    for method, accs in results.items():
        print(f"{method:<10}" + "".join(f"{a:>9.4f}" for a in accs) + f"{statistics.mean(accs):>9.4f}")
    return results


def fashion(args: argparse.Namespace) -> dict | None:
    from edgetrain.data import ArrayStream, load_fashion_mnist
    from edgetrain.registry import EdgetrainError

    try:
        test_x, test_y = load_fashion_mnist("test", image=True)
    except EdgetrainError as exc:
        print(f"\nFashion-MNIST skipped: {exc}")
        return None
    if args.fashion_test:
        test_x, test_y = test_x[:args.fashion_test], test_y[:args.fashion_test]
    test = [Batch(test_x[i:i + 500], test_y[i:i + 500]) for i in range(0, len(test_x), 500)]
    out = {}
    plans = {"bp": {}, "lw": {"view": "resnet-paper", "head_blocks": 1, "segments": 4},
             "segprop": {"view": "resnet-paper", "head_blocks": 1, "segments": 4}}
    # bp's epochs: by default the same as one stage (the paper's protocol); --fashion-bp-epochs gives bp
    # as many passes as a whole staged schedule instead.
    epochs = {"bp": args.fashion_bp_epochs or args.fashion_epochs, "lw": args.fashion_epochs,
              "segprop": args.fashion_epochs}
    with progress_bar(len(args.fashion_methods), description="fashion", unit="method") as bar:
        for method in args.fashion_methods:
            options = plans[method]
            model = build_resnet(ResNetConfig(num_classes=10, in_channels=1, stem="cifar"))
            model.head = MLPHead(512, 512, 10)
            train_x, train_y = load_fashion_mnist("train", image=True)
            if args.fashion_train:
                train_x, train_y = train_x[:args.fashion_train], train_y[:args.fashion_train]
            stream = ArrayStream(train_x, train_y, batch_size=args.fashion_batch, shuffle=True, seed=0)
            result = run_schedule(model, stream, method, epochs_per_stage=epochs[method], optimizer="adamw",
                                  lr=args.fashion_lr, optimizer_options={"weight_decay": 0.01}, eval_batches=test,
                                  **options)
            out[method] = result.final["accuracy"]
            bar.update()
    print(f"\nFashion-MNIST test accuracy, ResNet-18 (MLP head), {args.fashion_epochs} epochs per stage, batch "
          f"{args.fashion_batch}, AdamW {args.fashion_lr:g}, the first {args.fashion_train or 60000} training / "
          f"{len(test_x)} test images: "
          + ", ".join(f"{m} {a:.4f}" for m, a in out.items()) + f" (bp: {epochs['bp']} epochs)")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=SECTIONS, action="append")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--balance", nargs="+", default=list(SPLITS), choices=list(SPLITS),
                        help="segmentations in the memory table: equal blocks and balanced memory (GH=3 blocks, "
                             "Table 1's layout), the paper's ResNet-18 split (seg=4 only)")
    parser.add_argument("--head-grads-last", choices=["on", "off"], default="on",
                        help="SegProp's head_grads_last option in the memory table")
    parser.add_argument("--spill-waiting", choices=["on", "off"], default="off",
                        help="SegProp's spill_waiting option in the memory table (off: one more row has it on)")
    parser.add_argument("--checkpointing", nargs="+", default=["off", "on"], choices=["off", "on"],
                        help="activation checkpointing settings in the memory table")
    parser.add_argument("--snap-batches", type=int, default=4)
    parser.add_argument("--snap-epochs", type=int, default=2)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--fashion-epochs", type=int, default=1)
    parser.add_argument("--fashion-batch", type=int, default=128)
    parser.add_argument("--fashion-lr", type=float, default=3e-4)
    parser.add_argument("--fashion-methods", nargs="+", default=["bp", "lw", "segprop"],
                        choices=["bp", "lw", "segprop"])
    parser.add_argument("--fashion-bp-epochs", type=int, default=0,
                        help="bp's epochs (0 = --fashion-epochs, the same as one stage)")
    parser.add_argument("--fashion-train", type=int, default=0, help="train on the first N examples (0 = all)")
    parser.add_argument("--fashion-test", type=int, default=0, help="evaluate on the first N test images (0 = all)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("--png", help="bar chart of the headline comparison (memory, else SnapCheck)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    figures = {s: globals()[s](args) for s in SECTIONS if s in (args.only or SECTIONS[:4])}
    if args.json and not COMPARISONS:  # nothing compared (flops, accuracy only): the figures alone
        atomic_write_json(figures, args.json)
    elif args.json:
        write_json(args.json, *COMPARISONS[0][:3], headline=COMPARISONS[0][3], figures=figures, settings=vars(args),
                   comparisons={t: {"baseline": b, "ratios": ratios(x, b), "samples": y}
                                for x, b, y, t, _ in COMPARISONS})
    if args.png and COMPARISONS:
        write_png(args.png, *COMPARISONS[0][:2], COMPARISONS[0][4], title=COMPARISONS[0][3].split(",")[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
