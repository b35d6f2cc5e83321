"""`edgetrain export --method mesp`: a decoder's MeSP training program (edgetrain/export/mesp_program.py).

    edgetrain export --method mesp --model SmolLM2-135M-Instruct.Q4_1.gguf --seq 128 --batch 2 --out smollm2.pte
    # writes smollm2.pte (five methods) and smollm2.weights (the base as loaded: a GGUF's 4- and 8-bit blocks
    # stay packed), then --check N trains N AdamW steps in ExecuTorch and in torch's mesp and compares them.
"""
from __future__ import annotations

import argparse
import copy
import itertools
import json
import sys
from typing import TYPE_CHECKING, Callable

from edgetrain.registry import Registry

if TYPE_CHECKING:
    from edgetrain.export.mesp_program import AdamWSettings


def write_mesp_program(args: argparse.Namespace) -> int:
    from edgetrain.export.mesp_program import AdamWSettings
    from edgetrain.export.trainable import ExportError
    from edgetrain.training.schedules import check_learning_rate

    writer = MESP_WRITERS.get(args.runtime)  # an unknown runtime: an error naming the known ones
    if args.trainable not in (None, "lora"):
        raise ExportError("--method mesp trains LoRA adapters (--trainable lora)")
    return writer(args, AdamWSettings(lr=check_learning_rate(args.lr)))


def write_executorch_program(args: argparse.Namespace, optimizer: AdamWSettings) -> int:
    """--runtime executorch: the .pte of five methods and its weights file, checked against torch's mesp."""
    import torch

    import edgetrain
    from edgetrain.export import make_trainable, write_batch_file
    from edgetrain.export.mesp_program import MeSPProgramTrainer, export_mesp_program, mesp_reference
    from edgetrain.export.trainable import ExportError
    from edgetrain.utils.progress import begin_stage

    torch.manual_seed(args.seed)
    begin_stage(f"loading {args.model}")
    model = edgetrain.load_model(args.model, quantize_bits=args.quantize_bits)
    if getattr(model, "task", None) != "lm":
        raise ExportError(f"--method mesp is for decoders; {args.model} is a {getattr(model, 'task', '?')!r} model")
    if args.adapter:
        from edgetrain.adapters.convert import load_adapter

        load_adapter(model, args.adapter)
    make_trainable(model, "lora", rank=args.rank)
    reference = copy.deepcopy(model) if args.check else None
    begin_stage("exporting MeSP's step")
    program, weights = export_mesp_program(model, args.batch, args.seq, args.out, delegate=args.delegate)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"wrote {program} and {weights} (mesp, {len(model.blocks)} blocks of {args.model}: {trainable:,} LoRA "
          f"weights; batches of {args.batch} x {args.seq} tokens)")
    if not (args.batch_file or args.check):
        return 0
    from edgetrain.cli.export_stream import batch_stream

    steps = max(args.check, args.batch_steps if args.batch_file else 0)
    batches = list(itertools.islice(batch_stream(model, args), steps))
    if args.batch_file:
        write_batch_file(args.batch_file, batches[:args.batch_steps])
        print(f"wrote {args.batch_file} ({args.batch_steps} batches)")
    if args.check:
        begin_stage(f"training {args.check} steps in ExecuTorch and in torch's mesp")
        trainer = MeSPProgramTrainer(program, weights, optimizer)
        losses = [trainer.step(batch) for batch in batches[:args.check]]
        ref_losses, ref_adapters = mesp_reference(reference, batches[:args.check], optimizer)
        adapters = trainer.adapters()
        loss_error = max(abs(a - b) for a, b in zip(losses, ref_losses))
        adapter_error = max(float((adapters[name] - ref).abs().max()) for name, ref in ref_adapters.items())
        for step, (loss, ref) in enumerate(zip(losses, ref_losses), 1):
            print(f"step {step:3d}  loss {loss:.6f} (ExecuTorch)  {ref:.6f} (torch mesp)")
        print(json.dumps({"runtime": "executorch", "method": "mesp", "steps": args.check,
                          "max_loss_error": loss_error, "max_adapter_error": adapter_error}))
        if max(loss_error, adapter_error) > 1e-5:
            print("edgetrain export: the ExecuTorch run differs from torch's mesp by more than 1e-5", file=sys.stderr)
            return 1
    return 0


def write_mlx_functions(args: argparse.Namespace, optimizer: AdamWSettings) -> int:
    """--runtime mlx: the same step as MLX exported functions (edgetrain/export/mlx_program.py), checked against
    MLX's own mesp learner with --check."""
    import mlx.core as mx

    import edgetrain
    from edgetrain.backends.mlx.lora import add_lora, trainable_parameters
    from edgetrain.cli.export_stream import batch_stream
    from edgetrain.export.mlx_program import MLXProgramTrainer, export_mlx_mesp
    from edgetrain.utils.progress import begin_stage

    mx.random.seed(args.seed)
    begin_stage(f"loading {args.model}")
    model = edgetrain.load_model(args.model, backend="mlx", quantize_bits=args.quantize_bits)
    if args.adapter:
        from edgetrain.adapters.convert import load_adapter

        load_adapter(model, args.adapter)
    else:
        add_lora(model, rank=args.rank)
    reference = copy.deepcopy(model) if args.check else None
    begin_stage("exporting MeSP's step as MLX functions")
    directory = export_mlx_mesp(model, args.batch, args.seq, args.out)
    trainable = sum(array.size for array in trainable_parameters(model).values())
    print(f"wrote {directory} (mesp as MLX functions, {len(model.blocks)} blocks of {args.model}: {trainable:,} LoRA "
          f"weights; batches of {args.batch} x {args.seq} tokens)")
    if not args.check:
        return 0
    batches = list(itertools.islice(batch_stream(model, args), args.check))
    begin_stage(f"training {args.check} steps in the MLX functions and in MLX's mesp")
    trainer = MLXProgramTrainer(directory, lr=optimizer.lr, betas=optimizer.betas, eps=optimizer.eps,
                                weight_decay=optimizer.weight_decay)
    losses = [trainer.step(batch.inputs.numpy(), batch.targets.numpy()) for batch in batches]
    learner = edgetrain.Learner(reference, method="mesp", backend="mlx", optimizer="adamw", lr=optimizer.lr,
                                optimizer_options={"weight_decay": optimizer.weight_decay})
    ref_losses = [learner.step(batch).loss for batch in batches]
    ref_adapters, adapters = trainable_parameters(reference), trainer.adapters()
    loss_error = max(abs(a - b) for a, b in zip(losses, ref_losses))
    adapter_error = max(float(mx.max(mx.abs(adapters[name] - ref))) for name, ref in ref_adapters.items())
    for step, (loss, ref) in enumerate(zip(losses, ref_losses), 1):
        print(f"step {step:3d}  loss {loss:.6f} (MLX functions)  {ref:.6f} (MLX mesp)")
    print(json.dumps({"runtime": "mlx", "method": "mesp", "steps": args.check, "max_loss_error": loss_error,
                      "max_adapter_error": adapter_error}))
    if max(loss_error, adapter_error) > 1e-5:
        print("edgetrain export: the MLX functions differ from MLX's mesp by more than 1e-5", file=sys.stderr)
        return 1
    return 0


# --runtime -> the writer of MeSP's step for it.
MESP_WRITERS: Registry[Callable[[argparse.Namespace, "AdamWSettings"], int]] = Registry("MeSP export runtime")
MESP_WRITERS.add("executorch", write_executorch_program)
MESP_WRITERS.add("mlx", write_mlx_functions)
