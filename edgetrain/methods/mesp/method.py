"""`mesp`: Memory-efficient Structured Backpropagation (Park et al.) for LoRA fine-tuning of decoders.

Exact gradients, like `bp` and `mebp`, with the backward derived by hand instead of left to autograd:

  forward   blocks run one at a time under no_grad; only each block's input is kept ([B, T, D] per
            block), plus the final hidden state.
  head      loss and dL/d(final hidden) together in one pass over the LM head weight, in tiles of
            `loss_chunk` tokens x 4096 vocabulary entries (loss.py): the [B, T, vocab] logits
            (156 MB for 256 tokens of Qwen2.5's vocabulary in fp32) never exist.
  backward  blocks in reverse: each is recomputed from its stored input and differentiated by
            hand (block.py), its input freed, and its intermediates released before the next.
            The peak is one block's working set, bounded by the chunk sizes, plus the stored inputs.

LoRA's x @ A^T is recomputed where its gradient needs it instead of being stored (the paper's key
observation: it is [N, rank], cheap to redo); `store_lora_projection=True` keeps it instead, for the
paper's Table 5 ablation. Frozen weights (norms, embeddings, the tied or untied LM head, every
non-adapted projection) get no gradient; trainable parameters other than LoRA A/B are refused.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from edgetrain.data.batch import Batch
from edgetrain.methods.base import METHODS, apply_gradients, require_finite, trainable_parameters
from edgetrain.methods.mesp import step_buffers
from edgetrain.methods.mesp.block import BlockWeights, rope_tables_by_block
from edgetrain.methods.mesp.compiled import block_programs
from edgetrain.methods.mesp.loss import chunked_lm_loss, default_vocab_chunk
from edgetrain.models.llama import DecoderBlock, LlamaConfig, RMSNorm
from edgetrain.models.lora import LoRALinear
from edgetrain.models.quantized import QUANTIZED_HEADS, QuantizedEmbedding
from edgetrain.methods.configs import MeSPConfig, method_config
from edgetrain.registry import EdgetrainError

# The defaults (MeSPConfig's, shared with MLX) keep every matmul large enough to run at full speed
# while the peak stays within 2x from seq 256 to 1024; smaller chunks lower the peak at some speed.
# Query rows per attention chunk: the score temporaries are [B, H, chunk, T].
DEFAULT_ATTENTION_CHUNK = MeSPConfig.attention_chunk
# Tokens per MLP chunk: the temporaries are four [chunk, intermediate_size] buffers.
DEFAULT_MLP_CHUNK = MeSPConfig.mlp_chunk
# Tokens per loss tile row: the logits tile is [chunk, 4096].
DEFAULT_LOSS_CHUNK = MeSPConfig.loss_chunk

BlockGradientsHook = Callable[[int, dict[str, torch.Tensor]], None]


def check_decoder(model: nn.Module) -> None:
    """Refuse, with the reason, a model that is not a LlamaModel-style decoder (embed / blocks / head)."""
    problems = []
    if not isinstance(getattr(model, "config", None), LlamaConfig):
        problems.append("no LlamaConfig in model.config")
    if not isinstance(getattr(getattr(model, "embed", None), "embed_tokens", None), (nn.Embedding, QuantizedEmbedding)):
        problems.append("no token embedding at model.embed.embed_tokens")
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList) or not all(isinstance(b, DecoderBlock) for b in blocks):
        problems.append("model.blocks is not a ModuleList of DecoderBlocks")
    head = getattr(model, "head", None)
    if not isinstance(getattr(head, "norm", None), RMSNorm):
        problems.append("no final RMSNorm at model.head.norm")
    lm_head = getattr(head, "lm_head", None)
    if not (type(lm_head) is nn.Linear or isinstance(lm_head, QUANTIZED_HEADS)) or lm_head.bias is not None:
        problems.append("model.head.lm_head is not a bias-free nn.Linear (or a quantised one)")
    if problems:
        raise EdgetrainError(f"mesp works on LlamaModel-style decoders (edgetrain.models.llama); "
                             f"{type(model).__name__} does not fit: {'; '.join(problems)}. "
                             "Use 'mebp' or 'bp' for other models.")


def _lora_parameter_names(model: nn.Module) -> set[str]:
    names = set()
    for index, block in enumerate(model.blocks):
        for path, module in block.named_modules():
            if isinstance(module, LoRALinear):
                names.update({f"blocks.{index}.{path}.lora_A", f"blocks.{index}.{path}.lora_B"})
    return names


class StructuredBackprop:
    """The `mesp` training method (see the module docstring).

    fused_update: apply the optimizer to each block's LoRA parameters as soon as that block's
        gradients are computed (set their .grad, optimizer.step(), set them back to None), so the
        gradients of different blocks never coexist: gradient memory is one block's adapters
        instead of all blocks' (for Qwen2.5-0.5B at rank 8 on all seven projections, fp32: 0.7 MB
        instead of 17.6 MB). The result equals the unfused step for optimizers that update each
        parameter from its own gradient and state only -- torch's SGD, Adam and AdamW skip
        parameters whose .grad is None, so their per-parameter step counts stay right. Optimizers
        that couple parameters (global gradient-norm clipping, LBFGS) must not be fused. Memory the
        optimizer keeps (Adam's moments) is unchanged. `gradients()` never fuses.
    rollback: with fused_update, let the learner keep a copy of the adapters and optimizer state
        during each step so that a non-finite gradient found half-way (after later blocks were
        already updated) restores the last good step. The copy costs one adapter-sized buffer plus
        the optimizer state (Adam: three times the adapters), which can exceed MeSP's activation
        peak; rollback=False drops it, and such a step still raises but leaves the blocks updated
        before the bad gradient was found.
    store_lora_projection: keep each adapter's x @ A^T from the recomputed forward for its backward
        instead of recomputing it (the paper's Table 5 "store" ablation; [N, rank] per adapter).
    attention_chunk / mlp_chunk / loss_chunk: query rows / tokens / tokens per chunk; smaller
        chunks lower the peak, larger ones run fewer, bigger matmuls.
    vocab_chunk: vocabulary rows per loss tile (default 4096; 512 for a quantised head on a CPU).
    reuse_buffers: on a CPU, hand a step's large temporaries buffers it made earlier in the step once their
        tensors are gone (step_buffers.py): identical results, without a fresh mapping (and its page faults)
        per temporary. False allocates each as torch does.
    compile_blocks: run every block's forward and backward as two programs compiled once (torch.compile;
        compiled.py): on a GPU replayed as CUDA graphs. Off by default: a compile on the first step, and
        results within 1e-5 of eager rather than bit-equal.
    The options are edgetrain.methods.configs.MeSPConfig, shared with MLX's mesp.
    """

    # Its step is its gradients and one optimizer update: the learner may accumulate and clip them.
    gradient_step = True

    name = "mesp"

    def __init__(self, model: nn.Module, **options: Any) -> None:
        config = method_config("mesp", options)  # the options MLX's mesp takes too (methods/configs.py)
        self.fused_update, self.rollback = config.fused_update, config.rollback
        self.store_lora_projection = config.store_lora_projection
        self.attention_chunk, self.mlp_chunk, self.loss_chunk = config.attention_chunk, config.mlp_chunk, config.loss_chunk
        self.vocab_chunk = config.vocab_chunk
        self.reuse_buffers = config.reuse_buffers
        self.compile_blocks = config.compile_blocks
        check_decoder(model)
        self.model = model
        self.params = trainable_parameters(model)
        others = sorted(set(self.params) - _lora_parameter_names(model))
        if others:
            shown = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
            raise EdgetrainError(f"mesp is for LoRA fine-tuning: it computes gradients only for the LoRA "
                                 f"adapters (lora_A / lora_B) of the decoder blocks, but {shown} "
                                 f"{'is' if len(others) == 1 else 'are'} trainable too. Freeze "
                                 f"{'it' if len(others) == 1 else 'them'}, or use method 'mebp' "
                                 "(exact gradients for any trainable parameter, also memory-lean).")
        # Block-relative parameter name -> model parameter name, per block (for trainable ones only).
        self._names = [{local: f"blocks.{i}.{local}" for local, _ in block.named_parameters()
                        if f"blocks.{i}.{local}" in self.params} for i, block in enumerate(model.blocks)]

    def _vocab_chunk(self, dense_head: bool, device: torch.device) -> int:
        """The option, else loss.default_vocab_chunk."""
        return self.vocab_chunk if self.vocab_chunk is not None else default_vocab_chunk(not dense_head, device)

    @property
    def partial_updates(self) -> bool:
        """A fused step updates block by block; unless rollback is off, the learner snapshots the
        adapters and optimizer state first, so a non-finite gradient found half-way leaves the last
        good weights."""
        return self.fused_update and self.rollback

    def _check_batch(self, batch: Batch) -> None:
        inputs, targets = batch.inputs, batch.targets
        if inputs.dim() != 2 or inputs.dtype != torch.long:
            raise EdgetrainError(f"mesp: batch {batch.index}: inputs must be token ids [B, T] (long), "
                                 f"got {inputs.dtype} {tuple(inputs.shape)}")
        if targets.shape != inputs.shape:
            raise EdgetrainError(f"mesp: batch {batch.index}: targets {tuple(targets.shape)} do not match "
                                 f"inputs {tuple(inputs.shape)}")

    @torch.no_grad()
    def run(self, batch: Batch, on_block_gradients: BlockGradientsHook, require_finite_loss: bool = False) -> torch.Tensor:
        """Forward, chunked loss, and the reverse walk over the blocks; calls
        on_block_gradients(block index, {model parameter name: gradient}) for each block, last
        block first, as soon as its gradients exist. Returns the detached loss.
        require_finite_loss: raise NonFiniteError on a NaN/inf loss before any gradient exists."""
        self._check_batch(batch)
        reuse = self.reuse_buffers and step_buffers.available(batch.inputs.device)
        with step_buffers.step_buffers(enabled=reuse):
            return self._run(batch, on_block_gradients, require_finite_loss)

    def _run(self, batch: Batch, on_block_gradients: BlockGradientsHook, require_finite_loss: bool) -> torch.Tensor:
        model, config = self.model, self.model.config
        chunks = dict(attention_chunk=self.attention_chunk, mlp_chunk=self.mlp_chunk)
        hidden = model.embed(batch.inputs)
        weights = [BlockWeights.from_block(block, f"blocks.{i}") for i, block in enumerate(model.blocks)]
        ropes = rope_tables_by_block(config, weights, hidden.shape[1], hidden.device, hidden.dtype)
        forward, backward = block_programs(hidden.device, self.compile_blocks)
        block_inputs: list[torch.Tensor] = []
        for block_weights, rope in zip(weights, ropes):
            block_inputs.append(hidden)
            hidden = forward(block_weights, hidden, rope, **chunks)
        # Each phase (forward, loss, backward) starts with no free buffers: what one phase left free would sit
        # through the next one's peak, and their shapes differ (the loss's [tokens, vocabulary tile] tile).
        step_buffers.release_free()
        head = model.head
        dense_head = type(head.lm_head) is nn.Linear
        loss, grad = chunked_lm_loss(hidden, head.norm.weight, head.norm.eps,
                                     head.lm_head.weight if dense_head else head.lm_head,  # dequantised per tile
                                     batch.targets, self.loss_chunk, self._vocab_chunk(dense_head, hidden.device),
                                     soft_cap=head.soft_cap)
        if require_finite_loss:
            require_finite(float(loss), "loss")
        del hidden
        step_buffers.release_free()
        for index in reversed(range(len(weights))):
            block_input = block_inputs.pop()
            # A compiled program that wrote into its input could not be replayed as a CUDA graph.
            grad, block_grads = backward(weights[index], block_input, grad, ropes[index],
                                         overwrite_grad_out=not self.compile_blocks,
                                         store_lora_projection=self.store_lora_projection, **chunks)
            # Its memory, held since the forward, is given back: the pool may keep that much free from now on.
            step_buffers.make_room(block_input)
            del block_input
            names = self._names[index]
            on_block_gradients(index, {names[local]: g for local, g in block_grads.items() if local in names})
            del block_grads
        return loss.detach()

    def gradients(self, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        collected: dict[str, torch.Tensor] = {}
        loss = self.run(batch, lambda index, grads: collected.update(grads))
        return loss, {name: collected[name] if name in collected else torch.zeros_like(param)
                      for name, param in self.params.items()}

    def step(self, batch: Batch, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        # Stale gradients would be re-applied by every per-block optimizer.step() of a fused update.
        optimizer.zero_grad(set_to_none=True)
        if not self.fused_update:
            loss, grads = self.gradients(batch)
            require_finite(float(loss), "loss")
            apply_gradients(self.params, grads, optimizer)
            return loss

        def update_block(index: int, grads: dict[str, torch.Tensor]) -> None:
            block_params = [self.params[name] for name in grads]
            for param, grad in zip(block_params, grads.values()):
                param.grad = grad
            try:
                optimizer.step()
            finally:
                for param in block_params:
                    param.grad = None

        return self.run(batch, update_block, require_finite_loss=True)

    def state_dict(self) -> dict[str, Any]:
        return {}  # deterministic and stateless: the options come from the constructor

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


METHODS.add("mesp", StructuredBackprop)
