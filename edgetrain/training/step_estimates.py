"""Estimated memory one training step adds, per method, for a LlamaModel-style decoder -- from its shape
alone, without running anything.

The budget guard measures the methods it runs; these estimates rank the others in its refusal message
(a method not measured can still be named as the one to try). They count the tensors a step keeps
alive at its peak, as tensor accounting does (not the allocator's slack or kernel workspaces), from the
structure of each method; with N = batch x sequence tokens, e = the weights' element size, c = the
loss's compute element size (4 bytes, 8 for fp64: edgetrain.training.precision), per block h = hidden size,
q / kv = query / key-value width, i = intermediate size, r = the block's LoRA ranks together, L blocks,
V the vocabulary, and T = one block's trainable bytes (its gradients, or mezo's perturbed copies):

  bp    every block's saved activations, N e (4h + 3q + 2kv + 4i + r) each, plus the head's logits,
        their log-softmax and its gradient, 3 N V c, plus T
  mebp  every block's input, L N h e, plus the larger of the head (3 N V c) and one block recomputed
        under autograd with its gradients, N e (6h + 3q + 2kv + 5i + r), plus T
  mesp  every block's input plus the larger of one block's hand-derived working set (the attention half
        kept, and the larger of 4 [mlp_chunk, i] MLP temporaries and the attention's query, key and
        value rows with their gradients, 2 N (q + 2 kv) e, plus two of one attention chunk's scores) and
        one loss tile
        (loss_chunk x vocab_chunk logits), plus T; the chunks are the step's options (MeSPConfig)
  mezo  inference memory: the larger of the logits with their log-softmax (2 N V c) and one block's
        forward, plus T

With a quantised base (edgetrain.models.quantized) each method's block term also holds one dequantised
tile of a projection (edgetrain.models.quantized.tile_elements entries on the batch's device), and mesp's
loss term the head's dequantised vocabulary tile (edgetrain.methods.mesp.loss.default_vocab_chunk rows).

Checked against tensor accounting of the real first steps (tests/test_step_estimates.py and the
calibration behind it): fp32 and fp64 within 15% on the tiny preset and on SmolLM2-, Qwen2.5-0.5B- and
other shapes at 64-512 tokens (Qwen2.5-0.5B's shape: 0-5%); bf16 within 25%. Other methods and other
models have no estimate (None). mesp's figure is for temporaries allocated fresh (`reuse_buffers=False`); its
reused step buffers (edgetrain/methods/mesp/step_buffers.py, on by default on a CPU) hold some buffers whole
while smaller tensors use them: +8% of the step on SmolLM2's and Qwen2.5-0.5B's shapes (still within 10% of
this estimate), about +30% on tiny, whose stored block inputs are small.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from edgetrain.data.batch import Batch
from edgetrain.methods.configs import MeSPConfig, method_config
from edgetrain.methods.mesp.loss import default_vocab_chunk
from edgetrain.models.llama import LlamaConfig
from edgetrain.models.lora import LoRALinear
from edgetrain.models.quantized import QUANTIZED_HEADS, PackedMatrix, QuantizedEmbedding, tile_elements
from edgetrain.training.precision import compute_dtype


class _Shape:
    """The sizes the estimates are made of, read from the model and the batch."""

    def __init__(self, model: nn.Module, batch: Batch, mesp: MeSPConfig) -> None:
        config: LlamaConfig = model.config
        embedding = model.embed.embed_tokens
        weight_dtype = embedding.dtype if isinstance(embedding, PackedMatrix) else embedding.weight.dtype
        self.batch, self.seq = batch.inputs.shape[0], batch.inputs.shape[-1]
        self.tokens = batch.inputs.numel()
        self.layers = len(model.blocks)
        self.hidden, self.inner, self.vocab = config.hidden_size, config.intermediate_size, config.vocab_size
        self.heads = config.num_attention_heads
        self.query = config.num_attention_heads * config.head_dim
        self.kv = config.num_key_value_heads * config.head_dim
        self.element = torch.empty((), dtype=weight_dtype).element_size()
        self.loss_element = torch.empty((), dtype=compute_dtype(weight_dtype)).element_size()
        # A quantised base is dequantised one matrix at a time, in the compute dtype (plus the cast to a
        # narrower model dtype): the largest block projection, and one vocabulary tile of the head.
        dense_element = self.loss_element + (self.element if self.element != self.loss_element else 0)
        packed = [m for block in model.blocks for m in block.modules() if isinstance(m, PackedMatrix)]
        # Codes with a high plane (5- and 6-bit, Q3_K) gather its contributions into a second tile.
        tiles = 2 if any(m.layout.planes[1] for m in packed) else 1
        self.dense_projection = (min(max(self.inner, self.query, self.kv) * self.hidden,
                                     tile_elements(batch.inputs.device)) * dense_element * tiles if packed else 0)
        self.quantized_head = isinstance(getattr(model.head, "lm_head", None), QUANTIZED_HEADS)
        self.mesp = mesp  # mesp's chunk options
        self.vocab_chunk = mesp.vocab_chunk or default_vocab_chunk(self.quantized_head, batch.inputs.device)
        self.dense_head_tile = min(self.vocab, self.vocab_chunk) * self.hidden * dense_element

        ranks = [module.rank for module in model.blocks[0].modules() if isinstance(module, LoRALinear)]
        self.ranks = sum(ranks)
        # The trainable parameters of one block: its gradients (or, for mezo, its perturbed copies).
        self.block_trainable = sum(p.numel() * p.element_size() for p in model.blocks[0].parameters()
                                   if p.requires_grad)

    @property
    def upcast(self) -> bool:
        """Whether the loss runs in a wider dtype than the weights (bf16 / fp16 models)."""
        return self.element != self.loss_element

    def tokens_times(self, width: int) -> int:
        return self.tokens * width * self.element

    @property
    def block_inputs(self) -> int:
        return self.layers * self.tokens_times(self.hidden)

    @property
    def head(self) -> int:
        return 3 * self.tokens * self.vocab * self.loss_element


def _bp(shape: _Shape) -> int:
    per_block = shape.tokens_times(4 * shape.hidden + 3 * shape.query + 2 * shape.kv + 4 * shape.inner
                                   + shape.ranks)
    return shape.layers * per_block + shape.head + shape.block_trainable + shape.dense_projection


def _mebp(shape: _Shape) -> int:
    recomputed = shape.tokens_times(6 * shape.hidden + 3 * shape.query + 2 * shape.kv + 5 * shape.inner
                                    + shape.ranks)
    return shape.block_inputs + max(shape.head, recomputed + shape.dense_projection) + shape.block_trainable


def _mesp(shape: _Shape) -> int:
    mlp_rows = min(shape.tokens, shape.mesp.mlp_chunk)
    attention_rows = min(shape.seq, shape.mesp.attention_chunk)
    # The MLP's backward ends before the attention's begins: one of their working sets is alive at a time.
    # The attention's: the query/key/value rows and their gradients, and one chunk's scores and softmax.
    scores = shape.batch * shape.heads * attention_rows * shape.seq * shape.loss_element
    attention = 2 * shape.tokens_times(shape.query + 2 * shape.kv) + 2 * scores
    block = (shape.tokens_times(3 * shape.hidden + 2 * shape.query + 2 * shape.kv)
             + max(4 * mlp_rows * shape.inner * shape.element, attention) + shape.dense_projection)
    loss_rows, vocab_rows = min(shape.tokens, shape.mesp.loss_chunk), min(shape.vocab, shape.vocab_chunk)
    loss = (loss_rows * (vocab_rows + 2 * shape.hidden) * shape.loss_element + shape.tokens_times(shape.hidden))
    if shape.upcast:  # the tile's logits in the weights' dtype beside their upcast copy, and the weight block's
        loss += loss_rows * vocab_rows * shape.element + vocab_rows * shape.hidden * shape.loss_element
    if shape.quantized_head:  # the tile is dequantised, not a view of the weight
        loss += shape.dense_head_tile
    return shape.block_inputs + max(block, loss) + shape.block_trainable


def _mezo(shape: _Shape) -> int:
    block = shape.tokens_times(3 * shape.hidden + shape.query + 2 * shape.kv + 3 * shape.inner)
    # The logits, (upcast for a low-precision model) and their log-softmax inside the cross-entropy.
    logits = shape.tokens * shape.vocab * (2 * shape.loss_element + (shape.element if shape.upcast else 0))
    return max(logits, block + shape.dense_projection) + shape.block_trainable


ESTIMATES: dict[str, Callable[[_Shape], int]] = {"bp": _bp, "mebp": _mebp, "mesp": _mesp, "mezo": _mezo}


def is_decoder(model: nn.Module) -> bool:
    """A LlamaModel-style decoder: the shape the estimates read."""
    blocks = getattr(model, "blocks", None)
    embedding = getattr(getattr(model, "embed", None), "embed_tokens", None)
    return (isinstance(getattr(model, "config", None), LlamaConfig) and isinstance(blocks, nn.ModuleList)
            and len(blocks) > 0 and isinstance(embedding, (nn.Embedding, QuantizedEmbedding)))


def estimate_step_bytes(model: nn.Module, batch: Batch, method: str,
                        options: dict[str, Any] | None = None) -> int | None:
    """Estimated bytes one step of `method` adds on `batch` (see the module docstring); None for a
    method or model these estimates do not cover. `options` are the method's (mesp's chunk sizes count;
    a bad one is the method's EdgetrainError)."""
    estimate = ESTIMATES.get(method)
    if estimate is None or not is_decoder(model) or batch.inputs.dim() != 2:
        return None
    mesp = method_config("mesp", dict(options or {}) if method == "mesp" else {})
    return estimate(_Shape(model, batch, mesp))
