"""`edgetrain export --method mesp`: MeSP's step as an ExecuTorch program of five methods, and its weights file.

    files = export_mesp_program(model, batch_size=2, seq_len=128, out="smollm2.pte")
    # smollm2.pte: embed, block_forward, block_backward, head, adamw (edgetrain/export/mesp_graph.py)
    # smollm2.weights: the frozen weights (packed as loaded), the RoPE tables, each block's adapters and the
    #                  lists of which file tensors each method takes (edgetrain/export/weights_file.py)

A runner then drives the schedule MeSP's Python step follows (edgetrain/methods/mesp/method.py): embed,
every block forward keeping only its input, the head's loss and gradient, every block backward from its
stored input (last first), then AdamW on each block's adapter vector. `MeSPProgramTrainer` below is that
runner in Python over ExecuTorch's runtime; targets/executorch/ drives the same files natively.

Weights-file tensors a runner reads (besides the manifest, which is for Python and people):
    program.meta      int64 [FORMAT_VERSION, blocks, batch, seq, vocab, hidden, adapter numel, program crc32]
    inputs.embed      int64: indices (file order) of the tensors `embed` takes after the token ids
    inputs.head       int64: the same for `head`, after hidden and targets (the final norm first)
    inputs.block.{i}  int64: block i's frozen tensors, after x (and grad_out), cos, sin, adapters
    rope.cos, rope.sin, blocks.{i}.adapters (float32, the adapters the program starts from)
    adapters.layout   int64 [matrices, 3]: offset, rows, cols of each LoRA matrix in a block's vector
    adapters.names    uint8: their block-relative names, one a line (blocks.{i}. goes in front)
    adapters.metadata uint8: the metadata JSON of edgetrain's adapter file, for the runner to write
"""
from __future__ import annotations

import json
import math
import warnings
import zlib
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from edgetrain.data.batch import Batch
from edgetrain.export.mesp_graph import (ADAMW_SCALARS, AdamWPiece, BlockBackwardPiece, BlockForwardPiece,
                                         BlockLayout, EmbedPiece, HeadPiece, MatrixFormat, ProjectionLayout,
                                         pack_row_halves, pack_row_quarters, sign_codes)
from edgetrain.export.trainable import ExportError
from edgetrain.export.weights_file import WeightsFile, WeightsFileError, weights_file_bytes, write_weights_file
from edgetrain.files.atomic import atomic_write_bytes, ensure_writable_target
from edgetrain.files.space import check_free_space, check_room_for, tensor_bytes
from edgetrain.methods.base import NonFiniteError
from edgetrain.methods.configs import MeSPConfig
from edgetrain.methods.mesp.block import PROJECTIONS, BlockWeights, rope_tables
from edgetrain.methods.mesp.loss import DEFAULT_VOCAB_CHUNK
from edgetrain.methods.mesp.method import check_decoder
from edgetrain.models.lora import LORA_TARGETS, LoRALinear, lora_layers
from edgetrain.models.quantized import MatrixLayout, PackedMatrix, TiedQuantizedHead
from edgetrain.registry import EdgetrainError
from edgetrain.training.schedules import check_learning_rate
from edgetrain.utils.logs import get_logger

log = get_logger(__name__)

# 2: 4-bit codes in the int8 row_halves layout; 3: 8-bit codes signed; 4: wide codes and k-quant steps; 5: codes
# of 2 and 3 bits in row_halves, of 5 and 6 bits in row_quarters, the common format's codes in as few bits as
# they need (mesp_graph.MatrixFormat)
FORMAT_VERSION = 5
METHODS = ("embed", "block_forward", "block_backward", "head", "adamw")


@dataclass(frozen=True)
class ProgramShape:
    """What a program was exported for: a runner refuses files or batches that do not match."""

    blocks: int
    batch: int
    seq: int
    vocab: int
    hidden: int
    adapter_numel: int


def weights_path_for(program: str | Path) -> Path:
    """The weights file written beside `program`: the same name with the suffix .weights."""
    return Path(program).with_suffix(".weights")


def program_reads(layout: MatrixLayout) -> bool:
    """Whether a block program dequantises a packed matrix of this layout itself (GraphPackedMatrix): every
    affine GGUF block format (Q4_0 to Q8_0, the k-quants). IQ4_NL and IQ4_XS, on a non-uniform grid, go in
    dense (_converted_to_dense)."""
    return layout.codebook is None


def _converted_to_dense(model: nn.Module) -> dict[str, str]:
    """name -> its format, of each packed matrix the program holds dense (said once at export)."""
    return {name: module.layout.format_name or f"{module.bits}-bit" for name, module in model.named_modules()
            if isinstance(module, PackedMatrix) and not program_reads(module.layout)}


def _matrix(module: nn.Module | PackedMatrix | torch.Tensor) -> tuple[MatrixFormat, list[torch.Tensor]]:
    if isinstance(module, torch.Tensor):
        return MatrixFormat(*module.shape), [module.detach().to(torch.float32)]
    if isinstance(module, TiedQuantizedHead):
        module = module.table
    if isinstance(module, PackedMatrix) and not program_reads(module.layout):
        return _dense(module)
    if isinstance(module, PackedMatrix):
        layout = module.layout
        if module.bits == 8:
            matrix_format, codes = MatrixFormat(module.rows, module.cols, 8, signed=True), sign_codes(module.codes)
        elif module.bits == 4 and module.rows % 2:  # no row_halves: the codes as loaded (MatrixFormat)
            matrix_format, codes = MatrixFormat(module.rows, module.cols, 4), module.codes
        else:
            matrix_format, codes = _narrow_codes(module.unpacked_codes(), module.bits, layout.zero_point or 0)
        parts = [codes, module.scales] + ([module.scale_steps] if layout.steps else [])
        if module.biases is not None:
            parts += [module.biases] + ([module.bias_steps] if layout.steps else [])
        matrix_format = replace(matrix_format, group_size=module.group_size, zero_point=module.zero_point,
                                block_values=layout.block_values if layout.steps else 0,
                                subtracts_bias=layout.subtracts_bias)
        return matrix_format, [part.detach() for part in parts]
    return MatrixFormat(*module.weight.shape), [module.weight.detach().to(torch.float32)]


def _narrow_codes(codes: torch.Tensor, bits: int, wide_shift: int) -> tuple[MatrixFormat, torch.Tensor]:
    """The layout (rows and cols set, the rest MatrixFormat's defaults) and code tensor of codes of at most 6
    bits, uint8 [rows, cols]: row_halves up to 4 bits (rows even), row_quarters for 5 and 6 (rows a multiple of
    4); otherwise wide, a code a byte less `wide_shift` (a symmetric format's zero point, or the common
    format's code offset)."""
    rows, cols = codes.shape
    if bits <= 4 and rows % 2 == 0:
        return MatrixFormat(rows, cols, bits, row_halves=True), pack_row_halves(codes)
    if bits > 4 and rows % 4 == 0:
        return MatrixFormat(rows, cols, bits, row_quarters=True), pack_row_quarters(codes, bits)
    return MatrixFormat(rows, cols, bits, wide=True), (codes.to(torch.int16) - wide_shift).to(torch.int8)


def _common_matrices(modules: list[PackedMatrix]) -> list[tuple[MatrixFormat, list[torch.Tensor]]]:
    """Matrices of one projection held in different affine formats, in one format that holds each exactly:
    a code c (q less its zero point), an f16 scale and bias a block (the formats' smallest; a larger block's
    repeated), and an integer step a group for each (1 where a format has none; a subtracted minimum as a
    negative step, a symmetric format's bias 0). w = c (d s) + (m t), as each format's own arithmetic up to the
    sign of a zero. Codes that fit in 6 bits, made non-negative by the code offset (Q4_K's and Q6_K's: 0 to 15
    and -32 to 31), go in the narrow layouts (_narrow_codes); others (with an 8-bit format) a code a byte."""
    group = math.gcd(*(m.group_size for m in modules))
    block = math.gcd(*(m.layout.scale_columns for m in modules))
    lowest = min(-(m.layout.zero_point or 0) for m in modules)
    highest = max(2 ** m.bits - 1 - (m.layout.zero_point or 0) for m in modules)
    bits = (highest - lowest).bit_length()
    matrices = []
    for module in modules:
        layout = module.layout
        rows, cols = module.rows, module.cols
        per_scale = layout.scale_columns // block
        per_group = module.group_size // group
        codes = module.unpacked_codes().to(torch.int16) - (layout.zero_point or 0)
        if bits <= 6:
            matrix_format, narrow = _narrow_codes((codes - lowest).to(torch.uint8), bits, -lowest)
            matrix_format = replace(matrix_format, code_offset=0 if matrix_format.wide else -lowest)
        else:
            matrix_format, narrow = MatrixFormat(rows, cols, 8, wide=True), codes.to(torch.int8)
        scales = module.scales.to(torch.float32).repeat_interleave(per_scale, dim=1)
        ones = torch.ones(rows, cols // module.group_size, dtype=torch.int8)
        scale_steps = (module.scale_steps if layout.steps else ones).repeat_interleave(per_group, dim=1)
        if module.biases is None:
            biases = torch.zeros_like(scales)
            bias_steps = torch.zeros(rows, cols // group, dtype=torch.int8)
        else:
            biases = module.biases.to(torch.float32).repeat_interleave(per_scale, dim=1)
            steps = module.bias_steps.to(torch.int8) if layout.steps else ones
            bias_steps = (-steps if layout.subtracts_bias else steps).repeat_interleave(per_group, dim=1)
        matrix_format = replace(matrix_format, group_size=group, block_values=block)
        # f16 scales stay f16 (exact); a matrix quantised on load may hold float32 ones.
        storage = torch.float16 if all(m.scales.dtype == torch.float16 for m in modules) else torch.float32
        matrices.append((matrix_format, [narrow, scales.to(storage), scale_steps, biases.to(storage), bias_steps]))
    return matrices


def _dense(module: nn.Module) -> tuple[MatrixFormat, list[torch.Tensor]]:
    weight = module.dequantize(torch.float32) if isinstance(module, PackedMatrix) else module.weight
    return MatrixFormat(*weight.shape), [weight.detach().to(torch.float32)]


def _frozen_module(block: nn.Module, name: str) -> nn.Module:
    module = block.get_submodule(LORA_TARGETS[name])
    return module.base if isinstance(module, LoRALinear) else module


def _check_model(model: nn.Module) -> None:
    check_decoder(model)
    dtypes = {p.dtype for name, p in model.named_parameters()} | {
        m.dtype for m in model.modules() if isinstance(m, PackedMatrix)}
    if dtypes != {torch.float32}:
        raise ExportError(f"export --method mesp writes float32 programs; this model computes in "
                          f"{', '.join(sorted(str(d) for d in dtypes))} (load it with dtype float32)")
    if not lora_layers(model):
        raise ExportError("the model has no LoRA adapters to train: add them first (edgetrain.add_lora, or "
                          "make_trainable(model, 'lora'))")
    others = [name for name, p in model.named_parameters()
              if p.requires_grad and not name.endswith((".lora_A", ".lora_B"))]
    if others:
        raise ExportError(f"a MeSP program trains LoRA adapters only, but {others[0]} "
                          f"{'and ' + str(len(others) - 1) + ' more are' if len(others) > 1 else 'is'} trainable "
                          "too: freeze them (make_trainable(model, 'lora') does)")
    for index, block in enumerate(model.blocks):
        BlockWeights.from_block(block, f"blocks.{index}")  # refuses merged adapters, dropout, foreign layers
    _refuse_features_the_program_lacks(model.config)


# Decoder features the block program does not compute (Gemma 3's), by the config field that turns each on.
_PROGRAM_LACKS = {"sandwich_norms": "norms on the attention's and the MLP's outputs",
                  "scale_embeddings": "scaled token embeddings", "layer_types": "sliding-window layers",
                  "final_logit_softcapping": "a soft-capped head", "query_pre_attn_scalar": "an attention scale"}


def _refuse_features_the_program_lacks(config: Any) -> None:
    lacking = [what for field, what in _PROGRAM_LACKS.items()
               if getattr(config, field) not in (None, False) and not (
                   field == "layer_types" and "sliding_attention" not in getattr(config, field))
               and not (field == "query_pre_attn_scalar" and config.attention_scale == config.head_dim ** -0.5)]
    if config.hidden_activation != "silu":
        lacking.append(f"a {config.hidden_activation} MLP")
    if lacking:
        raise ExportError(f"export --method mesp: the native MeSP program does not compute {config.model_type}'s "
                          f"{', '.join(lacking)}; train this model with edgetrain's torch or MLX mesp (the program "
                          "covers llama, qwen2 and qwen3)")


def _block_layout(model: nn.Module, config: MeSPConfig) -> tuple[BlockLayout, list[list[torch.Tensor]]]:
    """The layout all blocks share, and each block's frozen tensors in that layout's order. A projection
    stays packed as it is when every block holds it in the same packed format; in several affine formats
    (a Q4_K_M file's Q4_K and Q6_K ffn_down) it goes in all blocks in one format that holds each exactly
    (_common_matrices); otherwise it goes dense in all."""
    blocks = list(model.blocks)
    first = BlockWeights.from_block(blocks[0])
    projections, per_projection = [], {}
    for name in PROJECTIONS:
        modules = [_frozen_module(block, name) for block in blocks]
        formats = {_matrix(module)[0] for module in modules}
        if len(formats) == 1:
            per_projection[name] = [_matrix(module) for module in modules]
        elif all(isinstance(m, PackedMatrix) and program_reads(m.layout) for m in modules):
            per_projection[name] = _common_matrices(modules)
        else:
            per_projection[name] = [_dense(module) for module in modules]
        adapters = [block.get_submodule(LORA_TARGETS[name]) for block in blocks]
        ranks = {module.rank if isinstance(module, LoRALinear) else 0 for module in adapters}
        scales = {float(module.scale) if isinstance(module, LoRALinear) else 1.0 for module in adapters}
        biases = {module.bias is not None for module in modules}
        if len(ranks) > 1 or len(scales) > 1 or len(biases) > 1:
            raise ExportError(f"export --method mesp needs every block's {LORA_TARGETS[name]} alike (one block "
                              f"program serves them all); they differ in LoRA rank {sorted(ranks)}, scale "
                              f"{sorted(scales)} or bias {sorted(biases)}")
        projections.append(ProjectionLayout(name, per_projection[name][0][0], biases.pop(), ranks.pop(),
                                            scales.pop()))
    layout = BlockLayout(tuple(projections), first.eps, first.num_heads, first.num_kv_heads, first.head_dim,
                         config.attention_chunk, config.mlp_chunk, head_norms=first.q_norm is not None)
    frozen = []
    for index, block in enumerate(blocks):
        norms = ["input_layernorm", "post_attention_layernorm"]
        norms += ["self_attn.q_norm", "self_attn.k_norm"] if layout.head_norms else []
        tensors = [block.get_submodule(name).weight.detach() for name in norms]
        for projection in projections:
            tensors += per_projection[projection.name][index][1]
            bias = _frozen_module(block, projection.name).bias
            if bias is not None:
                tensors.append(bias.detach())
        frozen.append(tensors)
    return layout, frozen


def _block_adapters(block: nn.Module, layout: BlockLayout) -> torch.Tensor:
    parts = [getattr(block.get_submodule(LORA_TARGETS[name]), part).detach().reshape(-1)
             for name, part, _, _ in layout.adapter_slices()]
    return torch.cat(parts).to(torch.float32) if parts else torch.zeros(0)


def _example_inputs(shape: ProgramShape, rope: tuple[torch.Tensor, torch.Tensor], frozen: list[torch.Tensor],
                    embed: list[torch.Tensor], head: list[torch.Tensor], adapters: torch.Tensor) -> dict[str, tuple]:
    """Each method's example inputs, every one its own tensor: torch.export takes one tensor passed twice
    for one input used twice, and would bake that aliasing into the program."""
    def ids() -> torch.Tensor:
        return torch.zeros(shape.batch, shape.seq, dtype=torch.long)

    def hidden() -> torch.Tensor:
        return torch.zeros(shape.batch, shape.seq, shape.hidden)

    def vector() -> torch.Tensor:
        return torch.zeros(shape.adapter_numel)

    def own(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return [t.clone() for t in tensors]

    cos, sin = rope
    return {"embed": (ids(), *own(embed)),
            "block_forward": (hidden(), cos.clone(), sin.clone(), adapters.clone(), *own(frozen)),
            "block_backward": (hidden(), hidden(), cos.clone(), sin.clone(), adapters.clone(), *own(frozen)),
            "head": (hidden(), ids(), *own(head)),
            "adamw": (vector(), vector(), vector(), vector(), torch.ones(len(ADAMW_SCALARS)))}


def _text(text: str) -> torch.Tensor:
    return torch.tensor(list(text.encode()), dtype=torch.uint8)


def export_mesp_program(model: nn.Module, batch_size: int, seq_len: int, out: str | Path,
                        config: MeSPConfig | None = None, delegate: str = "xnnpack") -> tuple[Path, Path]:
    """Write the MeSP training program of `model` (a decoder with LoRA adapters, its frozen base dense or
    packed as loaded) for batches of `batch_size` x `seq_len` tokens to `out` (.pte), and its weights file
    beside it (weights_path_for). Returns both paths. Nothing is written unless both can be. `delegate` lowers
    the matrix products to XNNPACK ("xnnpack", the default) or leaves them to ExecuTorch's CPU kernels
    ("none"; edgetrain.export.executorch.DELEGATES)."""
    from edgetrain.export.executorch import DELEGATES, lower_methods

    if not (isinstance(batch_size, int) and batch_size >= 1 and isinstance(seq_len, int) and seq_len >= 1):
        raise ExportError(f"batch size and sequence length must be positive integers, got {batch_size!r}, "
                          f"{seq_len!r}")
    config = config or MeSPConfig()
    DELEGATES.get(delegate)  # an unknown name fails here, not after minutes of lowering
    out = ensure_writable_target(out, "the program")
    ensure_writable_target(weights_path_for(out), "the program's weights file")
    _check_model(model)
    model_config = model.config
    if seq_len > model_config.max_position_embeddings:
        raise ExportError(f"seq {seq_len} exceeds the model's {model_config.max_position_embeddings} positions")
    converted = _converted_to_dense(model)
    if converted:
        dense_bytes = sum(4 * m.rows * m.cols for m in model.modules()
                          if isinstance(m, PackedMatrix) and not program_reads(m.layout))
        counts = Counter(converted.values())
        log.warning("export --method mesp: %d packed matrices (%s) go into the program as dense float32 (%.1f MiB): "
                    "its block programs dequantise affine block formats themselves, not a non-uniform grid (%s)",
                    len(converted), ", ".join(f"{name} x {n}" for name, n in sorted(counts.items())),
                    dense_bytes / 2 ** 20, ", ".join(list(converted)[:4]) + (", ..." if len(converted) > 4 else ""))
    layout, frozen = _block_layout(model, config)
    embedding = model.embed.embed_tokens
    embed_format, embed_tensors = _matrix(embedding)
    lm_head = model.head.lm_head
    tied = lm_head.weight is embedding.weight if isinstance(lm_head, nn.Linear) and isinstance(
        embedding, nn.Embedding) else isinstance(lm_head, TiedQuantizedHead)
    head_format, head_tensors = (embed_format, embed_tensors) if tied else _matrix(lm_head)
    vocab_chunk = config.vocab_chunk or DEFAULT_VOCAB_CHUNK
    shape = ProgramShape(len(model.blocks), batch_size, seq_len, model_config.vocab_size, model_config.hidden_size,
                         layout.adapter_numel())
    cos, sin = rope_tables(model_config, seq_len, torch.device("cpu"), torch.float32)
    adapters = [_block_adapters(block, layout) for block in model.blocks]
    pieces = {"embed": EmbedPiece(embed_format), "block_forward": BlockForwardPiece(layout),
              "block_backward": BlockBackwardPiece(layout),
              "head": HeadPiece(head_format, float(model.head.norm.eps), config.loss_chunk, vocab_chunk),
              "adamw": AdamWPiece()}
    examples = _example_inputs(shape, (cos, sin), frozen[0], embed_tensors,
                               [model.head.norm.weight.detach(), *head_tensors], adapters[0])
    weights = weights_path_for(out)
    # Lowering takes minutes with XNNPACK: a disk that cannot hold the weights file (the bytes of the tensors
    # it will hold, known now) is refused before it starts, not after.
    check_free_space(weights, tensor_bytes([cos, sin, *embed_tensors, model.head.norm.weight,
                                            *([] if tied else head_tensors), *(t for block in frozen for t in block),
                                            *adapters]), "the program's weights file")
    program = lower_methods(pieces, examples, delegate)
    program_crc = zlib.crc32(program)

    tensors: dict[str, torch.Tensor] = {}

    def add(name: str, tensor: torch.Tensor) -> int:
        tensors[name] = tensor.contiguous()
        return len(tensors) - 1

    add("program.meta", torch.tensor([FORMAT_VERSION, shape.blocks, shape.batch, shape.seq, shape.vocab,
                                      shape.hidden, shape.adapter_numel, program_crc], dtype=torch.long))
    add("rope.cos", cos)
    add("rope.sin", sin)
    embed_indices = [add(f"embed.{part}", t) for part, t in zip(embed_format.parts, embed_tensors)]
    head_indices = [add("head.norm", model.head.norm.weight.detach())]
    head_indices += embed_indices if tied else [add(f"head.{part}", t) for part, t in zip(head_format.parts,
                                                                                          head_tensors)]
    frozen_names = layout.frozen_names()
    block_indices = [[add(f"blocks.{i}.{name}", t) for name, t in zip(frozen_names, block_tensors)]
                     for i, block_tensors in enumerate(frozen)]
    for i, block_adapters in enumerate(adapters):
        add(f"blocks.{i}.adapters", block_adapters)
    slices = layout.adapter_slices()
    add("adapters.layout", torch.tensor([[offset, *part_shape] for _, _, offset, part_shape in slices],
                                        dtype=torch.long).reshape(-1, 3))
    add("adapters.names", _text("\n".join(f"{LORA_TARGETS[name]}.{part}" for name, part, _, _ in slices)))
    # The metadata of edgetrain's adapter file, as its checksum covers it (edgetrain.training.checkpoint.
    # payload_sha256): a native runner writes it verbatim and adds the checksum.
    add("adapters.metadata", _text(json.dumps({"lora_config": json.dumps(asdict(model.lora_config))},
                                              sort_keys=True, ensure_ascii=True)))
    add("inputs.embed", torch.tensor(embed_indices, dtype=torch.long))
    add("inputs.head", torch.tensor(head_indices, dtype=torch.long))
    for i, indices in enumerate(block_indices):
        add(f"inputs.block.{i}", torch.tensor(indices, dtype=torch.long))
    manifest = {"format": "edgetrain-mesp-program", "version": FORMAT_VERSION, "program_crc32": program_crc,
                "methods": list(METHODS), "shape": shape.__dict__, "tied_head": tied, "delegate": delegate,
                "model": {"model_type": model_config.model_type, "layers": shape.blocks,
                          "hidden_size": shape.hidden, "vocab_size": shape.vocab},
                "embed": embed_format.to_json(), "head": head_format.to_json(),
                "block": {"frozen": frozen_names, "eps": layout.eps, "heads": layout.num_heads,
                          "head_norms": layout.head_norms,
                          "kv_heads": layout.num_kv_heads, "head_dim": layout.head_dim,
                          "projections": [{"name": p.name, "rank": p.rank, "scale": p.scale, "bias": p.has_bias,
                                           **p.matrix.to_json()} for p in layout.projections],
                          "adapters": [{"name": f"{LORA_TARGETS[name]}.{part}", "offset": offset,
                                        "shape": list(part_shape)}
                                       for name, part, offset, part_shape in layout.adapter_slices()]},
                "chunks": {"attention": config.attention_chunk, "mlp": config.mlp_chunk,
                           "loss": config.loss_chunk, "vocab": vocab_chunk}}
    # Both sizes are known now: a disk that cannot take the two is refused before either is written, so a
    # full disk never leaves new weights beside the old program (a previous export stays usable).
    check_room_for({weights: weights_file_bytes(tensors, manifest), out: len(program)}, "the program's weights file")
    # The weights first: a crash between the two leaves an old program whose crc no longer matches the new
    # weights, which a runner refuses, rather than a new program with no weights.
    write_weights_file(weights, tensors, manifest)
    atomic_write_bytes(program, out)
    return out, weights


# -- the schedule, in Python over ExecuTorch's runtime -------------------------------------------------

@dataclass
class AdamWSettings:
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 1e-2

    def __post_init__(self) -> None:
        self.lr = check_learning_rate(self.lr)
        beta1, beta2 = self.betas
        # The native runner's bounds (targets/executorch/mesp_runner.cpp, its flags): what the replay takes, the
        # runner takes. eps 0 would divide a zero gradient's 0 by 0 (every such step refused as non-finite).
        for name, value, low, high, low_open in (("beta1", beta1, 0.0, 0.999999, False),
                                                 ("beta2", beta2, 0.0, 0.999999999, False),
                                                 ("eps", self.eps, 0.0, 1.0, True),
                                                 ("weight_decay", self.weight_decay, 0.0, 1e6, False)):
            if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                    and (low < value if low_open else low <= value) and value <= high):
                raise EdgetrainError(f"AdamW {name} must be a finite number in {'(' if low_open else '['}{low:g}, "
                                     f"{high:g}], got {value!r}")

    def scalars(self, step: int) -> torch.Tensor:
        """adamw's scalar input for update number `step` (from 1), computed in double as torch.optim does."""
        beta1, beta2 = self.betas
        values = {"decay": 1 - self.lr * self.weight_decay, "one_minus_beta1": 1 - beta1, "beta2": beta2,
                  "one_minus_beta2": 1 - beta2, "bias_correction2_sqrt": (1 - beta2 ** step) ** 0.5,
                  "eps": self.eps, "neg_step_size": -self.lr / (1 - beta1 ** step)}
        return torch.tensor([values[name] for name in ADAMW_SCALARS], dtype=torch.float32)


class MeSPProgramTrainer:
    """Runs an exported MeSP program's step schedule in ExecuTorch's Python runtime (what the native runner
    does in C++): `step(batch)` returns the loss before the update; `adapters()` the trained adapters by the
    model's parameter names. A step is all or nothing: a non-finite loss, gradient or update changes nothing."""

    runtime = "ExecuTorch (MeSP program)"

    def __init__(self, program: str | Path, weights: str | Path | None = None,
                 optimizer: AdamWSettings | None = None) -> None:
        from edgetrain.export.executorch import load_program

        from edgetrain.files.user import require_regular_file

        self.weights = WeightsFile(weights or weights_path_for(program))
        self.program_path = require_regular_file(program, ExportError, "the program")
        try:
            # The runtime reads the program from this buffer without copying it: it lives as long as we do.
            self._program_bytes = self.program_path.read_bytes()
        except OSError as exc:
            raise ExportError(f"{self.program_path}: cannot read the program: {exc.strerror or exc}") from exc
        self.shape = self._check_pair(self._program_bytes)
        self._module = load_program(self._program_bytes, self.program_path, METHODS)
        self.optimizer = optimizer or AdamWSettings()
        w = self.weights
        self._embed = [w.tensor(name) for name in self._names("inputs.embed")]
        self._head = [w.tensor(name) for name in self._names("inputs.head")]
        self._blocks = [[w.tensor(name) for name in self._names(f"inputs.block.{i}")] for i in range(self.shape.blocks)]
        self._rope = (w.tensor("rope.cos"), w.tensor("rope.sin"))
        self._adapters = [w.tensor(f"blocks.{i}.adapters").clone() for i in range(self.shape.blocks)]
        self._moments = [(torch.zeros_like(a), torch.zeros_like(a)) for a in self._adapters]
        self.steps_done = 0

    def _check_pair(self, program_bytes: bytes) -> ProgramShape:
        manifest, meta = self.weights.manifest, self.weights.tensor("program.meta")
        meta = meta.tolist() if meta.dtype == torch.int64 and meta.dim() == 1 else []
        if (len(meta) != 8 or meta[0] != FORMAT_VERSION or not isinstance(manifest, dict)
                or manifest.get("format") != "edgetrain-mesp-program"):
            raise WeightsFileError(f"{self.weights.path}: not a MeSP program's weights file (format version "
                                   f"{meta[0] if meta else None}, this edgetrain reads {FORMAT_VERSION})")
        if min(meta[1:7]) < 1:
            raise WeightsFileError(f"{self.weights.path}: program.meta is damaged (sizes {meta[1:7]})")
        if zlib.crc32(program_bytes) != meta[7]:
            raise ExportError(f"{self.program_path} is not the program {self.weights.path} was written with "
                              "(another model or shape, or a damaged file): export them again together")
        return ProgramShape(*meta[1:7])

    def _names(self, index_tensor: str) -> list[str]:
        order = list(self.weights.entries)
        indices = self.weights.tensor(index_tensor)
        # A negative index would pick a tensor from the end: as damaged as one past it.
        if indices.dtype != torch.int64 or any(not 0 <= i < len(order) for i in indices.flatten().tolist()):
            raise WeightsFileError(f"{self.weights.path}: {index_tensor} points past the file's tensors")
        return [order[i] for i in indices.flatten().tolist()]

    def _run(self, method: str, inputs: tuple) -> list[torch.Tensor]:
        try:
            return list(self._module.run_method(method, inputs))
        except RuntimeError as exc:
            raise ExportError(f"{self.program_path}: method {method} failed in the ExecuTorch runtime: {exc}") from exc

    def check_batch(self, batch: Batch) -> None:
        expected = (self.shape.batch, self.shape.seq)
        for what, tensor in (("inputs", batch.inputs), ("targets", batch.targets)):
            if tuple(tensor.shape) != expected or tensor.dtype != torch.long:
                raise ExportError(f"batch {batch.index}: {what} {tuple(tensor.shape)} {tensor.dtype}; the program "
                                  f"takes {expected} int64 (fixed at export)")
        ids = batch.inputs
        if int(ids.min()) < 0 or int(ids.max()) >= self.shape.vocab:
            raise ExportError(f"batch {batch.index}: token ids [{int(ids.min())}, {int(ids.max())}] outside the "
                              f"vocabulary [0, {self.shape.vocab})")
        targets = batch.targets
        bad = (targets != -100) & ((targets < 0) | (targets >= self.shape.vocab))
        if bool(bad.any()):
            raise ExportError(f"batch {batch.index}: target ids outside the vocabulary [0, {self.shape.vocab})")

    def step(self, batch: Batch) -> float:
        self.check_batch(batch)
        cos, sin = self._rope
        hidden = self._run("embed", (batch.inputs.contiguous(), *self._embed))[0]
        block_inputs = []
        for adapters, frozen in zip(self._adapters, self._blocks):
            block_inputs.append(hidden)
            hidden = self._run("block_forward", (hidden, cos, sin, adapters, *frozen))[0]
        loss, grad = self._run("head", (hidden, batch.targets.contiguous(), *self._head))
        if not math.isfinite(float(loss)):
            raise NonFiniteError(f"batch {batch.index}: the loss is {float(loss)}; nothing was changed")
        grads: list[torch.Tensor] = [torch.empty(0)] * self.shape.blocks
        for index in reversed(range(self.shape.blocks)):
            grad, grads[index] = self._run("block_backward", (block_inputs.pop(), grad, cos, sin,
                                                              self._adapters[index], *self._blocks[index]))
            if not bool(torch.isfinite(grads[index]).all()):
                raise NonFiniteError(f"batch {batch.index}: a non-finite gradient in block {index}; nothing "
                                     "was changed")
        scalars = self.optimizer.scalars(self.steps_done + 1)
        updated = []
        for index, (adapters, (exp_avg, exp_avg_sq)) in enumerate(zip(self._adapters, self._moments)):
            result = self._run("adamw", (adapters, grads[index], exp_avg, exp_avg_sq, scalars))
            if not all(bool(torch.isfinite(t).all()) for t in result):
                raise NonFiniteError(f"batch {batch.index}: the AdamW update of block {index} came out non-finite; "
                                     "nothing was changed")
            updated.append(result)
        for index, (adapters, exp_avg, exp_avg_sq) in enumerate(updated):
            self._adapters[index], self._moments[index] = adapters.clone(), (exp_avg.clone(), exp_avg_sq.clone())
        self.steps_done += 1
        return float(loss)

    def adapters(self) -> dict[str, torch.Tensor]:
        """{model parameter name: tensor} of every block's LoRA A and B."""
        slices = self.weights.manifest["block"]["adapters"]
        return {f"blocks.{i}.{item['name']}": adapters[item["offset"]:item["offset"] + math.prod(item["shape"])]
                .view(item["shape"]).clone() for i, adapters in enumerate(self._adapters) for item in slices}


def mesp_reference(model: nn.Module, batches: list[Batch], optimizer: AdamWSettings) -> tuple[list[float],
                                                                                             dict[str, Any]]:
    """The same steps by edgetrain's Learner (torch, mesp, AdamW): losses and the trained adapters."""
    from edgetrain.training.learner import Learner

    learner = Learner(model, method="mesp", optimizer="adamw", lr=optimizer.lr,
                      optimizer_options={"betas": optimizer.betas, "eps": optimizer.eps,
                                         "weight_decay": optimizer.weight_decay})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        losses = [learner.step(batch).loss for batch in batches]
    adapters = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    return losses, adapters
