"""`edgetrain export --merge`: the model with its adapter merged, as a Hugging Face checkpoint directory
or (for a GGUF base) a GGUF file."""
from __future__ import annotations

import argparse
from pathlib import Path


def _gguf_base(model_arg: str) -> Path:
    """The GGUF file --model names (a path, or a pretrained name that resolves to one)."""
    from edgetrain.export.merged import MergeError
    from edgetrain.models.downloads import DOWNLOADS, fetch

    path = Path(model_arg)
    if model_arg in DOWNLOADS and not path.exists():
        path = fetch(model_arg)
    if path.suffix.lower() != ".gguf":
        raise MergeError(f"--out ends in .gguf but --model {model_arg} is not a GGUF model: a merged GGUF keeps "
                         "its base file's metadata and tokenizer; write a checkpoint directory instead")
    return path


def write_merged(args: argparse.Namespace) -> int:
    import edgetrain
    from edgetrain.export.merged import MergeError, save_merged_gguf, save_merged_hf
    from edgetrain.backends.load_options import LoadOptions
    from edgetrain.models import parse_dtype
    from edgetrain.utils.progress import begin_stage

    if args.adapter is None:
        raise MergeError("--merge needs --adapter (the adapter to merge into --model)")
    to_gguf = str(args.out).lower().endswith(".gguf")
    base = _gguf_base(args.model) if to_gguf else args.model
    # Merged weights are dense: the base is read dequantised, whatever its file stores packed.
    begin_stage(f"loading {args.model} dequantised, with {args.adapter}")
    model = edgetrain.load_model(base, adapter=args.adapter, options=LoadOptions(dequantize=True))
    begin_stage(f"writing {args.out}")
    if to_gguf:
        written = save_merged_gguf(model, base, args.out, args.merge_dtype or "f16")
    else:
        written = save_merged_hf(model, args.out, parse_dtype(args.merge_dtype) if args.merge_dtype else None)
    print(f"wrote {written} ({args.model} with {args.adapter} merged)")
    return 0
