"""`edgetrain export --method mesp --runtime mlx`: MeSP's step as MLX exported functions (the paper's own route).

    directory = export_mlx_mesp(model, batch_size=2, seq_len=128, out="smollm2-mlx")
    # embed.mlxfn, block_forward.mlxfn, block_backward.mlxfn, head.mlxfn, adamw.mlxfn (mx.export_function),
    # weights.safetensors (the frozen base as held, packed when quantised; the adapters; RoPE tables),
    # manifest.json (each function's inputs and outputs by name; each file's size and SHA-256; its own SHA-256)

Each function is edgetrain's MLX mesp code (edgetrain/backends/mlx/methods/) traced with the arrays it reads
as inputs: a template block (a copy of block 0) takes the block's arrays by name, so one block function
serves every block and the base stays as the model holds it (a QuantizedLinear's packed weight, scales and
biases). Its chunk and phase evaluations are deferred while it is traced (edgetrain/backends/mlx/evaluation.py).
`adamw` is mlx.optimizers.AdamW's update of one array, exported shapeless so it serves every adapter.

`MLXProgramTrainer` replays the schedule with mx.import_function, as an app (Swift: MLX's
`importFunction`) would; docs/export.md sketches that app. It trusts nothing in the directory: MLX's readers
of .mlxfn and .safetensors files crash the process (a segfault, std::bad_alloc) or load wrong numbers from a
damaged file, so every file's size and SHA-256 are checked against the manifest before MLX sees a byte, and the
manifest against its own SHA-256 and against the weights it describes (edgetrain/export/mlx_manifest.py).
"""
from __future__ import annotations

import copy
import json
import math
import numbers
import os
from pathlib import Path
from typing import Any, Callable

from edgetrain.export.mlx_manifest import (FILES, FORMAT, FORMAT_VERSION, FUNCTIONS, LAYOUT_FIELDS, LAYOUT_KEY,
                                           MANIFEST, MAX_DIMENSION, WEIGHTS, check_manifest, check_tensors,
                                           file_record, import_verified, layout, manifest_digest, read_manifest,
                                           verified_bytes)
from edgetrain.export.trainable import ExportError
from edgetrain.files.atomic import atomic_write_directory, ensure_writable_target, readable_directory
from edgetrain.methods.base import NonFiniteError
from edgetrain.methods.configs import MeSPConfig
from edgetrain.training.schedules import check_learning_rate


def _flat(module: Any) -> list[tuple[str, Any]]:
    from mlx.utils import tree_flatten

    return tree_flatten(module.parameters())


def _with_arrays(template: Any, names: list[str], arrays: tuple) -> Any:
    from mlx.utils import tree_unflatten

    template.update(tree_unflatten(list(zip(names, arrays))))
    return template


def _check_model(model: Any) -> None:
    from edgetrain.backends.mlx.lora import LoRALinear
    from edgetrain.backends.mlx.model import MLXDecoder

    if not isinstance(model, MLXDecoder):
        raise ExportError(f"--runtime mlx exports MLX decoders (load_model(..., backend='mlx')), not a "
                          f"{type(model).__name__}")
    lora = [name for name, module in model.named_modules() if isinstance(module, LoRALinear)]
    if not lora:
        raise ExportError("the model has no LoRA adapters to train: add them first (edgetrain.backends.mlx.lora."
                          "add_lora)")
    block_layouts = {tuple((name, tuple(array.shape), str(array.dtype)) for name, array in _flat(block))
                     for block in model.blocks}
    if len(block_layouts) != 1:
        raise ExportError("every block must hold the same arrays (one block function serves them all); these "
                          "blocks differ in their adapters or in how their base is stored")


def export_mlx_mesp(model: Any, batch_size: int, seq_len: int, out: str | Path,
                    config: MeSPConfig | None = None) -> Path:
    """Write MeSP's step for `model` (an MLX decoder with LoRA) and batches of batch_size x seq_len tokens into
    the directory `out` (replaced whole, crash-safe). Returns the directory."""
    import mlx.core as mx

    from edgetrain.backends.mlx.evaluation import deferred
    from edgetrain.backends.mlx.lora import trainable_parameters
    from edgetrain.backends.mlx.methods.mesp import chunked_lm_loss
    from edgetrain.backends.mlx.methods.mesp_block import BlockWeights, block_backward, block_forward
    from edgetrain.methods.mesp.loss import DEFAULT_VOCAB_CHUNK

    if not all(isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_DIMENSION
               for value in (batch_size, seq_len)):
        raise ExportError(f"batch size and sequence length must be positive integers, got {batch_size!r}, "
                          f"{seq_len!r}")
    config = config or MeSPConfig()
    out = ensure_writable_target(out, "the MLX program directory", directory=True)
    _check_model(model)
    chunks = dict(attention_chunk=config.attention_chunk, mlp_chunk=config.mlp_chunk)
    vocab_chunk = config.vocab_chunk or DEFAULT_VOCAB_CHUNK
    block_names = [name for name, _ in _flat(model.blocks[0])]
    lora_names = [name for name in block_names if name.rsplit(".", 1)[-1] in ("lora_a", "lora_b")]
    embed_names = [name for name, _ in _flat(model.embed)]
    block_template = copy.deepcopy(model.blocks[0])
    embed_template = copy.deepcopy(model.embed)
    norm_eps = float(model.head.norm.eps)
    dtype = model.head.norm.weight.dtype
    cos, sin = model.rope(seq_len, dtype)
    ids = mx.zeros((batch_size, seq_len), dtype=mx.int32)
    hidden = mx.zeros((batch_size, seq_len, model.config.hidden_size), dtype=dtype)
    block_arrays = [array for _, array in _flat(model.blocks[0])]

    def embed(token_ids: mx.array, *arrays: mx.array) -> mx.array:
        return _with_arrays(embed_template, embed_names, arrays)(token_ids)

    def forward(x: mx.array, cos: mx.array, sin: mx.array, *arrays: mx.array) -> mx.array:
        weights = BlockWeights.from_block(_with_arrays(block_template, block_names, arrays))
        return block_forward(weights, x, (cos, sin), **chunks)

    def backward(x: mx.array, grad_out: mx.array, cos: mx.array, sin: mx.array, *arrays: mx.array) -> tuple:
        weights = BlockWeights.from_block(_with_arrays(block_template, block_names, arrays))
        grad_x, grads = block_backward(weights, x, grad_out, (cos, sin), **chunks)
        return (grad_x, *(grads[name] for name in lora_names))

    def head(hidden: mx.array, targets: mx.array, norm: mx.array, lm_weight: mx.array) -> tuple:
        return chunked_lm_loss(hidden, norm, norm_eps, lm_weight, targets, config.loss_chunk, vocab_chunk)

    def adamw(param: mx.array, grad: mx.array, m: mx.array, v: mx.array, lr: mx.array, weight_decay: mx.array,
              beta1: mx.array, one_minus_beta1: mx.array, beta2: mx.array, one_minus_beta2: mx.array,
              eps: mx.array) -> tuple:
        # mlx.optimizers.AdamW.apply_single, then Adam.apply_single (bias_correction=False, its default).
        param = param * (1 - lr * weight_decay)
        m = beta1 * m + one_minus_beta1 * grad
        v = beta2 * v + one_minus_beta2 * mx.square(grad)
        return param - lr * m / (mx.sqrt(v) + eps), m, v

    scalar = mx.array(0.5, dtype=mx.float32)
    vector = mx.zeros((4,), dtype=dtype)
    examples: dict[str, tuple[Callable, tuple, bool]] = {
        "embed": (embed, (ids, *[array for _, array in _flat(model.embed)]), False),
        "block_forward": (forward, (hidden, cos, sin, *block_arrays), False),
        "block_backward": (backward, (hidden, hidden, cos, sin, *block_arrays), False),
        "head": (head, (hidden, ids, model.head.norm.weight, model.lm_head_weight()), False),
        "adamw": (adamw, (vector, vector, vector, vector, *([scalar] * 7)), True)}
    tensors = {"rope.cos": cos, "rope.sin": sin, "head.norm": model.head.norm.weight}
    tensors.update({f"embed.{name}": array for name, array in _flat(model.embed)})
    tied = bool(model.config.tie_word_embeddings)
    if not tied:
        tensors["head.lm_weight"] = model.lm_head_weight()
    for index, block in enumerate(model.blocks):
        tensors.update({f"blocks.{index}.{name}": array for name, array in _flat(block)})
    manifest = {"format": FORMAT, "version": FORMAT_VERSION, "batch": batch_size, "seq": seq_len,
                "vocab": model.config.vocab_size, "hidden": model.config.hidden_size, "blocks": len(model.blocks),
                "block_arrays": block_names, "lora_arrays": lora_names, "embed_arrays": embed_names,
                "head_lm_weight": "embed.embed_tokens.weight" if tied else "head.lm_weight",
                "trainable": sorted(trainable_parameters(model)),
                "functions": {
                    "embed": {"inputs": ["token_ids (int32 [batch, seq])", "embed.<embed_arrays>"], "outputs": ["hidden"]},
                    "block_forward": {"inputs": ["x", "rope.cos", "rope.sin", "blocks.<i>.<block_arrays>"],
                                      "outputs": ["block output"]},
                    "block_backward": {"inputs": ["x", "grad_out", "rope.cos", "rope.sin", "blocks.<i>.<block_arrays>"],
                                       "outputs": ["grad_x", "<lora_arrays> gradients"]},
                    "head": {"inputs": ["hidden", "targets (int32, -100: none)", "head.norm", "<head_lm_weight>"],
                             "outputs": ["loss", "grad_hidden"]},
                    "adamw": {"inputs": ["param", "grad", "m", "v", "lr", "weight_decay", "beta1", "1 - beta1",
                                         "beta2", "1 - beta2", "eps"], "outputs": ["param", "m", "v"],
                              "shapeless": True, "note": "vectors of any length: pass each array flattened"}},
                "chunks": {"attention": config.attention_chunk, "mlp": config.mlp_chunk, "loss": config.loss_chunk,
                           "vocab": vocab_chunk}}

    def write(directory: Path) -> None:
        with deferred():
            for name, (function, arguments, shapeless) in examples.items():
                try:
                    mx.export_function(str(directory / f"{name}.mlxfn"), function, *arguments, shapeless=shapeless)
                except (ValueError, RuntimeError) as exc:
                    raise ExportError(f"MLX could not export the {name} function: {exc}") from exc
        mx.save_safetensors(str(directory / WEIGHTS), tensors, metadata={LAYOUT_KEY: layout(manifest)})
        manifest["files"] = {name: file_record(directory / name) for name in FILES}
        manifest["manifest_sha256"] = manifest_digest(manifest)
        (directory / MANIFEST).write_text(json.dumps(manifest, indent=1))

    # The weights file holds at least the tensors' bytes: a disk that cannot is refused before anything is traced.
    return atomic_write_directory(out, write, needed=sum(int(array.nbytes) for array in tensors.values()))


def _real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _adamw_scalars(lr: Any, betas: Any, eps: Any, weight_decay: Any) -> list[float]:
    """adamw.mlxfn's scalar inputs (lr, weight_decay, beta1, 1 - beta1, beta2, 1 - beta2, eps), or
    ExportError naming the setting: each must be finite as a float32, the function's type."""
    import numpy as np

    lr = check_learning_rate(lr)
    if isinstance(betas, (str, bytes)) or not hasattr(betas, "__len__") or len(betas) != 2:
        raise ExportError(f"AdamW betas must be a pair (beta1, beta2), got {betas!r}")
    beta1, beta2 = betas
    for name, value, low, high in (("beta1", beta1, 0.0, 1.0), ("beta2", beta2, 0.0, 1.0)):
        if not (_real(value) and math.isfinite(value) and low <= value < high):
            raise ExportError(f"AdamW {name} must be a finite number in [{low}, {high}), got {value!r}")
    # eps 0 divides the zero gradients of a fresh adapter by zero; eps or a decay past float32 is inf there.
    if not (_real(eps) and math.isfinite(eps) and np.float32(eps) > 0 and eps <= 1.0):
        raise ExportError(f"AdamW eps must be a number in (0, 1] that float32 holds above 0, got {eps!r}")
    if not (_real(weight_decay) and math.isfinite(weight_decay) and 0 <= weight_decay <= 1e6):
        raise ExportError(f"AdamW weight_decay must be a finite number in [0, 1e6], got {weight_decay!r}")
    return [float(v) for v in (lr, weight_decay, beta1, 1 - beta1, beta2, 1 - beta2, eps)]


class MLXProgramTrainer:
    """Replays an exported MLX MeSP program with mx.import_function (what an app does): `step(inputs,
    targets)` returns the loss before the update; `adapters()` the trained LoRA arrays by model name. A step
    is all or nothing: a non-finite loss, gradient or update, or a function that fails, changes nothing.
    Loading checks every file against the manifest's sizes and SHA-256s before MLX reads it; anything damaged,
    swapped, missing or not a regular file is an ExportError naming the file (and the field, for the manifest).
    The files must not change while the trainer is being built."""

    runtime = "MLX (exported functions)"

    def __init__(self, directory: str | Path, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01) -> None:
        import mlx.core as mx

        scalars = _adamw_scalars(lr, betas, eps, weight_decay)
        if not isinstance(directory, (str, os.PathLike)):
            raise ExportError(f"the program directory must be a path, got {type(directory).__name__}")
        try:
            # After a crash between atomic_write_directory's two renames the complete old version is aside.
            self.directory = readable_directory(directory)
            is_directory = self.directory.is_dir()
        except (OSError, ValueError) as exc:
            raise ExportError(f"{directory}: cannot read the program directory ({exc})") from None
        if not is_directory:
            state = "is not a directory" if os.path.lexists(self.directory) else "does not exist"
            raise ExportError(f"{self.directory} {state}: an exported MLX program is a directory (edgetrain export "
                              "--method mesp --runtime mlx)")
        self.manifest = read_manifest(self.directory)
        check_manifest(self.directory, self.manifest)
        manifest = self.manifest
        records = manifest["files"]
        verified_bytes(self.directory / WEIGHTS, records[WEIGHTS], keep=False)
        try:
            self.tensors, metadata = mx.load(str(self.directory / WEIGHTS), format="safetensors",
                                             return_metadata=True)
        except Exception as exc:  # checked above: only a file changed since then gets here
            raise ExportError(f"{self.directory / WEIGHTS}: MLX cannot load it ({type(exc).__name__}: {exc})") from exc
        if not isinstance(self.tensors, dict) or metadata.get(LAYOUT_KEY) != layout(manifest):
            raise ExportError(f"{self.directory / WEIGHTS}: its array layout ({LAYOUT_KEY}) is not the one "
                              f"manifest.json describes ({', '.join(LAYOUT_FIELDS)}): the manifest was rewritten "
                              "or the files come from different exports; re-export the program")
        check_tensors(self.directory, manifest, self.tensors)
        self.functions = {}
        for name in FUNCTIONS:
            path = self.directory / f"{name}.mlxfn"
            self.functions[name] = import_verified(path, verified_bytes(path, records[path.name], keep=True))
        self._scalars = [mx.array(value, dtype=mx.float32) for value in scalars]
        self._moments = {name: (mx.zeros_like(self.tensors[name]), mx.zeros_like(self.tensors[name]))
                         for name in manifest["trainable"]}
        self.steps_done = 0

    def _block(self, index: int) -> list:
        return [self.tensors[f"blocks.{index}.{name}"] for name in self.manifest["block_arrays"]]

    def _token_ids(self, what: str, values: Any, ignore: int | None) -> Any:
        """`values` as int32 [batch, seq] token ids in [0, vocab) (or `ignore`), or ExportError. The range is
        checked before the cast: a narrowing cast would wrap an id far outside the vocabulary into it."""
        import mlx.core as mx
        import numpy as np

        try:
            array = np.asarray(values)
        except Exception as exc:  # a ragged list, an object whose __array__ fails
            raise ExportError(f"{what}: not an array of token ids ({type(exc).__name__}: {exc})") from None
        expected = (self.manifest["batch"], self.manifest["seq"])
        if array.dtype.kind not in "iu":
            raise ExportError(f"{what}: token ids must be integers, got {array.dtype}")
        if array.shape != expected:
            raise ExportError(f"{what}: batches of {array.shape} tokens; the program takes {expected} (fixed at export)")
        vocab = self.manifest["vocab"]
        valid = array if ignore is None else array[array != ignore]
        if valid.size == 0:
            raise ExportError(f"{what}: every target is ignored ({ignore}): nothing to learn from")
        low, high = int(valid.min()), int(valid.max())
        if low < 0 or high >= vocab:
            raise ExportError(f"{what}: token id {low if low < 0 else high} outside the vocabulary [0, {vocab})")
        return mx.array(array.astype(np.int32))

    def _run(self, name: str, arguments: list, shapes: list[tuple[int, ...]]) -> list:
        """The outputs of function `name`, evaluated and of the shapes the schedule needs, or ExportError."""
        import mlx.core as mx

        try:
            outputs = list(self.functions[name](*arguments))
            mx.eval(*outputs)
        except Exception as exc:  # MLX refuses inputs that do not fit the traced function with ValueError
            raise ExportError(f"{self.directory / (name + '.mlxfn')} failed ({type(exc).__name__}: {exc}); nothing "
                              "was changed") from exc
        got = [tuple(output.shape) for output in outputs]
        if got != [tuple(shape) for shape in shapes]:
            raise ExportError(f"{self.directory / (name + '.mlxfn')} returned arrays of shapes {got}, not {shapes}: "
                              "not this program's function; nothing was changed")
        return outputs

    def step(self, inputs: Any, targets: Any) -> float:
        import mlx.core as mx

        manifest = self.manifest
        inputs = self._token_ids("inputs", inputs, None)
        targets = self._token_ids("targets", targets, -100)
        hidden_shape = (manifest["batch"], manifest["seq"], manifest["hidden"])
        cos, sin = self.tensors["rope.cos"], self.tensors["rope.sin"]
        embed = [self.tensors[f"embed.{name}"] for name in manifest["embed_arrays"]]
        (hidden,) = self._run("embed", [inputs, *embed], [hidden_shape])
        stored = []
        for index in range(manifest["blocks"]):
            stored.append(hidden)
            (hidden,) = self._run("block_forward", [hidden, cos, sin, *self._block(index)], [hidden_shape])
        loss, grad = self._run("head", [hidden, targets, self.tensors["head.norm"],
                                        self.tensors[manifest["head_lm_weight"]]], [(), hidden_shape])
        if not math.isfinite(float(loss)):
            raise NonFiniteError(f"the loss is {float(loss)}; nothing was changed")
        lora_shapes = [tuple(self.tensors[f"blocks.0.{name}"].shape) for name in manifest["lora_arrays"]]
        grads = {}
        for index in reversed(range(manifest["blocks"])):
            grad, *lora = self._run("block_backward", [stored.pop(), grad, cos, sin, *self._block(index)],
                                    [hidden_shape, *lora_shapes])
            grads.update({f"blocks.{index}.{name}": g for name, g in zip(manifest["lora_arrays"], lora)})
        updated = {}
        for name, gradient in grads.items():
            m, v = self._moments[name]
            shape = gradient.shape
            # adamw is exported for vectors (shapeless keeps the rank): every array goes through it flat.
            flat = self._run("adamw", [*(t.reshape(-1) for t in (self.tensors[name], gradient, m, v)),
                                       *self._scalars], [(gradient.size,)] * 3)
            updated[name] = [t.reshape(shape) for t in flat]
            mx.eval(*updated[name])
            if not all(bool(mx.all(mx.isfinite(t))) for t in (gradient, *updated[name])):
                raise NonFiniteError(f"a non-finite gradient or update of {name}; nothing was changed")
        for name, (param, m, v) in updated.items():
            self.tensors[name], self._moments[name] = param, (m, v)
        self.steps_done += 1
        return float(loss)

    def adapters(self) -> dict[str, Any]:
        return {name: self.tensors[name] for name in self.manifest["trainable"]}
