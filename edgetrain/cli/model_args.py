"""The flags that pick a model and its adapter, shared by the subcommands that read a trained model
(generate, eval), and loading them."""
from __future__ import annotations

import argparse
from types import ModuleType
from typing import Any

from edgetrain.backends.load_options import LoadOptions, add_load_flags


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny",
                        help="preset, pretrained name (edgetrain list models), checkpoint directory or .gguf file")
    parser.add_argument("--backend", default="torch-cpu")
    add_load_flags(parser)
    parser.add_argument("--adapter", default=None,
                        help="a LoRA adapter to apply: edgetrain's .safetensors (what train --save-adapter "
                             "wrote), a PEFT or an mlx-lm adapter directory")


def text_functions(args: argparse.Namespace) -> ModuleType:
    """generate_ids / generate / held_out_loss for the models of the backend args name (Backend.text_out);
    refuses a backend that cannot generate or evaluate text."""
    from edgetrain.backends import get_backend
    from edgetrain.registry import EdgetrainError

    backend = get_backend(args.backend)
    if not backend.reads_text_out:
        raise EdgetrainError(f"backend {args.backend!r} cannot generate or evaluate text yet")
    return backend.text_functions()


def load_model_and_adapter(args: argparse.Namespace) -> Any:
    """The model args name, with its adapter loaded when --adapter is given (by the backend's adapter
    loader: the same files load on torch and MLX)."""
    import edgetrain
    from edgetrain.backends import get_backend
    from edgetrain.registry import EdgetrainError
    from edgetrain.utils.progress import begin_stage

    backend = get_backend(args.backend)
    begin_stage(f"loading {args.model}")  # a pretrained name is fetched first, once: a 93 MB download
    model = edgetrain.load_model(args.model, backend=args.backend, options=LoadOptions.from_args(args))
    if getattr(model, "task", None) != "lm":
        raise EdgetrainError(f"--model {args.model}: a {type(model).__name__} is not a language model")
    if args.adapter is not None:
        backend.load_adapter(model, args.adapter)  # edgetrain file, PEFT or mlx-lm directory: detected
    return model
