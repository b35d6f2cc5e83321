"""Export a model's trainable part for on-device training: an ExecuTorch .pte or ONNX Runtime artifacts.

The program takes (inputs, targets) of fixed shapes and returns the loss; the device runtime computes the
gradients of the trainable weights (LoRA adapters of a decoder, or a classifier's head over its frozen
features) and applies SGD. With --check N the export is trained for N steps in the runtime from Python
and compared with the same steps of a torch Learner (loss and weights). --batch-file writes N batches
of the stream to the binary file the native runner (targets/executorch) reads.

With --method mesp (decoders with LoRA) it writes instead MeSP's step as an ExecuTorch program of five
methods and a weights file beside it, the frozen base packed as loaded (edgetrain/cli/export_mesp.py).

With --merge it writes instead the model with its adapter merged into the weights, for runtimes that
do not train: a Hugging Face checkpoint directory, or (--out ending in .gguf, for a GGUF base model) a
GGUF file in F32 or F16 that llama.cpp loads (edgetrain/export/merged.py).

    edgetrain export --merge --model smollm2-135m --adapter adapter.safetensors --out merged-hf/
    edgetrain export --merge --model smollm2-135m --adapter adapter.safetensors --out merged.gguf --merge-dtype f16
"""
from __future__ import annotations

import argparse
import copy
import itertools
import json
import sys


def build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--model", default="tiny", help="preset name or checkpoint directory")
    parser.add_argument("--trainable", choices=("lora", "head"), default=None,
                        help="what learns: LoRA adapters (decoders, the default for them) or the head "
                             "(classifiers, the default for them)")
    parser.add_argument("--runtime", choices=("executorch", "onnxruntime", "mlx"), default="executorch",
                        help="executorch (.pte), onnxruntime (a directory of artifacts) or, with --method mesp, mlx "
                             "(a directory of MLX exported functions)")
    parser.add_argument("--method", choices=("bp", "mesp"), default="bp",
                        help="bp: one joint forward-backward program, SGD (default); mesp: MeSP's step as five "
                             "methods (embedding, block forward, block backward, head, AdamW) over a weights "
                             "file beside the .pte, the frozen base kept packed as loaded (decoders with LoRA)")
    parser.add_argument("--delegate", default="xnnpack",
                        help="with --method mesp --runtime executorch: lower the matrix products and tensor "
                             "operators to XNNPACK (xnnpack, the default) or leave them to ExecuTorch's own CPU "
                             "kernels (none)")
    parser.add_argument("--quantize-bits", type=int, choices=(4, 8), default=None, metavar="N",
                        help="with --method mesp: quantise the base's dense matrices to N bits on load")
    parser.add_argument("--out", required=True, help="the .pte file (executorch) or a directory (onnxruntime)")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank")
    parser.add_argument("--adapter", default=None,
                        help="start from this LoRA adapter (any format: edgetrain file, PEFT, mlx-lm, GGUF)")
    parser.add_argument("--merge", action="store_true",
                        help="write the model with --adapter merged (a Hugging Face directory, or a GGUF file "
                             "when --out ends in .gguf) instead of a training program")
    parser.add_argument("--merge-dtype", default=None,
                        help="weights of the merged model: float32/float16/bfloat16 for a directory (default: "
                             "the model's), f32 or f16 for a GGUF (default f16)")
    parser.add_argument("--batch", type=int, default=4, help="batch size (fixed in the program)")
    parser.add_argument("--seq", type=int, default=64, help="sequence length of decoders (fixed in the program)")
    parser.add_argument("--data", default=None, help="stream for --check/--batch-file: text (decoders) or "
                                                     "digits (classifiers) by default")
    parser.add_argument("--check", type=int, default=0, metavar="N",
                        help="train N steps in the runtime and in torch and compare (SGD; AdamW for mesp)")
    parser.add_argument("--lr", type=float, default=None,
                        help="learning rate of --check (default 0.05 for SGD, 1e-3 for mesp's AdamW)")
    parser.add_argument("--batch-file", default=None, metavar="PATH",
                        help="also write --batch-steps batches of the stream here (native runner input)")
    parser.add_argument("--batch-steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    return parser


def main(args: argparse.Namespace) -> int:
    import torch

    import edgetrain
    from edgetrain.cli.export_stream import batch_stream
    from edgetrain.export import (RUNTIMES, default_part, export_training, load_trainer, make_trainable,
                                  torch_sgd_trajectory, write_batch_file)
    from edgetrain.utils.progress import begin_stage

    if args.merge:
        from edgetrain.cli.export_merged import write_merged

        return write_merged(args)
    if args.method == "mesp":
        from edgetrain.cli.export_mesp import write_mesp_program

        args.lr = 1e-3 if args.lr is None else args.lr
        return write_mesp_program(args)
    args.lr = 0.05 if args.lr is None else args.lr
    if args.runtime not in RUNTIMES:
        raise edgetrain.EdgetrainError(f"--runtime {args.runtime} writes MeSP's step (--method mesp); it has no "
                                       "joint forward-backward program")
    if args.quantize_bits is not None:
        raise edgetrain.EdgetrainError("--quantize-bits is for --method mesp (the joint program holds fp32 weights)")
    torch.manual_seed(args.seed)
    begin_stage(f"loading {args.model}")
    model = edgetrain.load_model(args.model)
    part = args.trainable or default_part(model)
    if args.adapter:
        from edgetrain.adapters.convert import load_adapter

        load_adapter(model, args.adapter)
    make_trainable(model, part, rank=args.rank)
    stream = batch_stream(model, args)
    steps = max(args.check, args.batch_steps if args.batch_file else 0, 1)
    batches = list(itertools.islice(stream, steps))
    reference = copy.deepcopy(model) if args.check else None
    begin_stage(f"exporting the {args.runtime} training program")
    path = export_training(model, batches[0], args.runtime, args.out)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"wrote {path} ({args.runtime}; {part} of {args.model}: {trainable:,} trainable weights; "
          f"inputs {tuple(batches[0].inputs.shape)} {batches[0].inputs.dtype}, "
          f"targets {tuple(batches[0].targets.shape)})")
    if args.batch_file:
        write_batch_file(args.batch_file, batches[:args.batch_steps])
        print(f"wrote {args.batch_file} ({args.batch_steps} batches)")
    if args.check:
        begin_stage(f"training {args.check} steps in {args.runtime} and in torch")
        trainer = load_trainer(args.runtime, path, args.lr, batches[0])
        losses = [trainer.step(batch) for batch in batches[:args.check]]
        ref_losses, ref_weights = torch_sgd_trajectory(reference, batches[:args.check], args.lr)
        weights = trainer.parameters()
        loss_error = max(abs(a - b) for a, b in zip(losses, ref_losses))
        weight_error = max(float((weights[name] - ref).abs().max()) for name, ref in ref_weights.items())
        for step, (loss, ref) in enumerate(zip(losses, ref_losses), 1):
            print(f"step {step:3d}  loss {loss:.6f} ({trainer.runtime})  {ref:.6f} (torch)")
        print(json.dumps({"runtime": args.runtime, "steps": args.check, "max_loss_error": loss_error,
                          "max_weight_error": weight_error}))
        if max(loss_error, weight_error) > 1e-5:
            print(f"edgetrain export: the {trainer.runtime} run differs from torch by more than 1e-5",
                  file=sys.stderr)
            return 1
    return 0
