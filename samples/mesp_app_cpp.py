"""An app that is not a Python process trains LoRA with MeSP from its own token stream, in the native runner.

1. ship time (Python, once): `export_mesp_program` writes the model's MeSP program (.pte: embed, block
   forward, block backward, head, AdamW) and its weights file (the frozen base, 4-bit packed here);
2. the app (any language): turns its user's text into token ids, cuts them into the program's fixed
   [batch, seq] windows and writes them to a batch file (here in Python, the same bytes a C++ or Kotlin app
   would write: edgetrain/export/stream_file.py); held-out windows are kept aside;
3. device: `edgetrain_mesp_runner` (targets/executorch/mesp_runner.cpp) trains the adapters with MeSP's
   schedule, checkpointing every step (the app may be killed and relaunched: `--checkpoint` resumes), and
   writes edgetrain's adapter file;
4. check: the held-out loss of the model with that adapter, before and after; and the runner's losses and
   adapters against the program's Python replay (bit for bit) and torch's mesp (within 1e-5).

    python samples/mesp_app_cpp.py                       # builds the runner in build/native; 40 steps
    python samples/mesp_app_cpp.py --quick               # 6 steps of the XNNPACK program (the slow lane runs it)
    python samples/mesp_app_cpp.py --quick --delegate none   # ExecuTorch's own kernels: lowers in seconds (ctest)
    python samples/mesp_app_cpp.py --runner build/native/edgetrain_mesp_runner --text my-notes.txt
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch

import edgetrain
from edgetrain.data.batch import Batch
from edgetrain.export import make_trainable, write_batch_file
from edgetrain.export.mesp_program import AdamWSettings, MeSPProgramTrainer, export_mesp_program, mesp_reference
from edgetrain.export.native import MESP_RUNNER, REPO, build_runner, run_mesp_runner
from edgetrain.training.losses import lm_loss

TOLERANCE = 1e-5  # losses against torch's mesp
# Adapters against torch's mesp, as a fraction of how far training moved each tensor. AdamW's first steps move
# every entry by about +-lr whatever its gradient's size (m / sqrt(v) is its sign), so an entry whose gradient is
# near eps follows the last bits of the two implementations' summation order (docs/export.md, Parity): no fixed
# absolute bound holds for every program and kernel choice, while the trained change itself is what must agree.
ADAPTER_TOLERANCE = 1e-2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="few steps: a check that everything runs")
    parser.add_argument("--steps", type=int, default=None, help="runner steps (default 40, quick 6)")
    parser.add_argument("--text", default=None, help="the user's text (default: a part of Python's docs)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--runner", default=None, help="a built edgetrain_mesp_runner (default: build one)")
    parser.add_argument("--workdir", default="mesp_app_cpp", help="where the program, batches and adapter go")
    parser.add_argument("--delegate", default="xnnpack",
                        help="xnnpack (default: what an app ships; lowering tiny takes minutes) or none "
                             "(ExecuTorch's own kernels: seconds to lower, slower to run)")
    return parser


def user_text(path: str | None) -> str:
    if path is not None:
        return Path(path).read_text(encoding="utf-8")
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics)[:12])


def app_windows(text: str, batch: int, seq: int) -> list[Batch]:
    """What the app does with its own tokens: `tiny` reads bytes; each window of seq + 1 tokens gives the
    inputs and the next-token targets; `batch` windows a batch."""
    tokens = torch.tensor(list(text.encode("utf-8")), dtype=torch.long)
    windows = tokens[:len(tokens) // (seq + 1) * (seq + 1)].view(-1, seq + 1)
    return [Batch(group[:, :-1].contiguous(), group[:, 1:].contiguous(), index)
            for index, group in enumerate(windows[:len(windows) // batch * batch].split(batch))]


def held_out_loss(model: torch.nn.Module, batches: list[Batch]) -> float:
    with torch.no_grad():
        return sum(float(lm_loss(model(b.inputs), b.targets)) for b in batches) / len(batches)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    steps = args.steps or (6 if args.quick else 40)
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)

    # 1. Ship time: the program and its weights file, the base packed to 4 bits.
    model = make_trainable(edgetrain.load_model("tiny", quantize_bits=4), "lora", rank=8)
    base = copy.deepcopy(model)
    program, weights = export_mesp_program(model, args.batch, args.seq, workdir / "tiny-mesp.pte",
                                           delegate=args.delegate)
    print(f"exported {program} and {weights}")

    # 2. The app's own token stream, as the batch file the runner reads; the last windows held out.
    windows = app_windows(user_text(args.text), args.batch, args.seq)
    held_out, train = windows[-4:], windows[:-4][:steps]
    batch_file = write_batch_file(workdir / "user-batches.bin", train)

    # 3. The device: MeSP in the native runner, checkpointed every step.
    binary = Path(args.runner) if args.runner else build_runner(REPO / "build" / "native", target=MESP_RUNNER)
    adapter_file = workdir / "user-adapter.safetensors"
    # The program was just written anew: an earlier run's checkpoint trained another export (and a finished
    # one would resume with no step left to take).
    (workdir / "runner.ckpt").unlink(missing_ok=True)
    native = run_mesp_runner(binary, program, batch_file, lr=args.lr, checkpoint=workdir / "runner.ckpt",
                             save=adapter_file)
    print(f"native runner: loss {native.losses[0]:.4f} -> {native.losses[-1]:.4f} over {len(native.losses)} steps")

    # 4. The adapter, loaded as any edgetrain adapter; and the same steps in the Python replay and in torch.
    from edgetrain.adapters.convert import load_adapter

    initial = {name: p.detach().clone() for name, p in base.named_parameters() if p.requires_grad}
    before = held_out_loss(base, held_out)
    trained = copy.deepcopy(base)
    load_adapter(trained, adapter_file)
    after = held_out_loss(trained, held_out)
    print(f"held-out loss on the user's text: {before:.4f} before, {after:.4f} with the runner's adapter")
    settings = AdamWSettings(lr=args.lr)
    report = {"steps": len(native.losses), "held_out_before": before, "held_out_after": after}
    if len(native.losses) == len(train):  # a resumed run printed only its own steps
        replay = MeSPProgramTrainer(program, weights, settings)
        replay_losses = [replay.step(batch) for batch in train]
        torch_losses, torch_adapters = mesp_reference(copy.deepcopy(base), train, settings)
        report.update({
            "bit_equal_to_python_replay": native.losses == replay_losses and all(
                torch.equal(native.adapter[n], v) for n, v in replay.adapters().items()),
            "max_loss_diff_vs_torch": max(abs(a - b) for a, b in zip(native.losses, torch_losses)),
            "max_adapter_diff_vs_torch": max(float((native.adapter[n] - t).abs().max())
                                             for n, t in torch_adapters.items()),
            "max_adapter_diff_vs_torch_of_change": max(
                float((native.adapter[n] - t).abs().max() / (t - initial[n]).abs().max().clamp_min(1e-12))
                for n, t in torch_adapters.items())})
    print(json.dumps(report))
    ok = (after < before and report.get("bit_equal_to_python_replay", True)
          and report.get("max_loss_diff_vs_torch", 0) <= TOLERANCE
          and report.get("max_adapter_diff_vs_torch_of_change", 0) <= ADAPTER_TOLERANCE)
    if not ok:
        print("the runner's adapter did not lower the held-out loss, or differs from the replay or torch",
              file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
