"""Promises of MeSP that mutation testing found unguarded (tools/mutation mesp, docs/mutation.md): each
test here kills mutants of edgetrain/methods/mesp/ that every other test let survive. Named after the
promise, not the mutant.

The method is driven through its protocol (gradients(batch), step(batch, optimizer)), and block.py, ops.py
and loss.py through their functions, on a small random float64 decoder (GQA, q/k/v biases, LoRA on every
projection with a non-zero B) so that exactness can be asserted tightly and every gradient term is
non-trivial. Memory promises (which buffers are reused or consumed, what is recomputed instead of kept)
are checked through buffer identity, a count of the LoRA projections, or the peak of live tensor bytes
measured by edgetrain.probes.tensors.TensorAccountant."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import edgetrain
from edgetrain.data.batch import Batch
from edgetrain.methods import METHODS
import edgetrain.methods.mesp.method as mesp_method
import edgetrain.methods.mesp.ops as mesp_ops
from edgetrain.methods.mesp.block import BlockWeights, block_backward, block_forward, rope_tables
from edgetrain.methods.mesp.loss import DEFAULT_VOCAB_CHUNK, chunked_lm_loss
from edgetrain.methods.mesp.ops import (LinearWeights, LoRAGradients, accumulate_matmul, causal_attention_backward,
                                        causal_attention_forward, linear_group_forward, rms_norm_forward)
from edgetrain.models.llama import LlamaConfig, LlamaModel
from edgetrain.probes.tensors import TensorAccountant
from edgetrain.registry import EdgetrainError
from testkit import random_lora_b

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 31


def small_decoder(seed: int = 0, **overrides) -> LlamaModel:
    """A 2-block float64 decoder (6 query heads over 2 KV heads, q/k/v biases) with rank-2 LoRA on all
    seven projections and random B (a fresh B is zero, which zeroes every A gradient)."""
    torch.manual_seed(seed)
    config = LlamaConfig(**{**dict(vocab_size=VOCAB, hidden_size=24, intermediate_size=40, num_hidden_layers=2,
                                   num_attention_heads=6, num_key_value_heads=2, head_dim=4,
                                   attention_bias=True), **overrides})
    model = LlamaModel(config)
    model.init_weights(std=0.1, seed=seed)
    edgetrain.add_lora(model, rank=2)
    random_lora_b(model, seed + 1, 0.05)
    return model.double()


def token_batch(batch: int = 2, seq_len: int = 7, seed: int = 0) -> Batch:
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randint(0, VOCAB, (batch, seq_len), generator=generator)
    targets = torch.randint(0, VOCAB, (batch, seq_len), generator=generator)
    return Batch(inputs, targets)


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


def unchanged(model: nn.Module, before: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(t, before[name]) for name, t in model.state_dict().items())


def block_inputs(model: LlamaModel, seq_len: int = 7, seed: int = 0):
    """Block 0's weights, a random input x [2, T, D], a random dL/d(output) and the RoPE tables."""
    generator = torch.Generator().manual_seed(seed)
    dim = model.config.hidden_size
    x = torch.randn(2, seq_len, dim, generator=generator, dtype=torch.float64)
    grad_out = torch.randn(2, seq_len, dim, generator=generator, dtype=torch.float64)
    rope = rope_tables(model.config, seq_len, x.device, x.dtype)
    return BlockWeights.from_block(model.blocks[0]), x, grad_out, rope


def max_relative_error(reference: dict[str, torch.Tensor], estimate: dict[str, torch.Tensor]) -> float:
    assert estimate.keys() == reference.keys()
    return max(float((estimate[k] - ref).abs().max() / ref.abs().max()) for k, ref in reference.items())


# -- options and batches -------------------------------------------------------------------------------

def test_documented_defaults():
    # docs/methods/mesp.md: the loss runs in tiles of 256 tokens x 4096 vocabulary rows; the chunk defaults are the
    # measured ones of method.py; nothing is fused or stored unless asked, and a fused step can roll back.
    method = METHODS.get("mesp")(small_decoder())
    assert (method.attention_chunk, method.mlp_chunk, method.loss_chunk) == (64, 256, 256)
    assert DEFAULT_VOCAB_CHUNK == 4096
    assert (method.fused_update, method.rollback, method.store_lora_projection) == (False, True, False)
    assert not method.partial_updates


def test_options_are_keyword_only_and_the_model_may_be_named():
    # Six options, three of them flags: keyword-only, so that none lands in a wrong slot.
    model = small_decoder()
    with pytest.raises(TypeError):
        mesp_method.StructuredBackprop(model, True)  # type: ignore[misc]
    method = mesp_method.StructuredBackprop(model=model, fused_update=True)
    assert method.model is model and method.fused_update


@pytest.mark.parametrize("inputs", [torch.zeros(7, dtype=torch.long), torch.zeros(2, 7, 1, dtype=torch.long),
                                    torch.zeros(2, 7), torch.zeros(2, 7, dtype=torch.int32)])
def test_a_batch_that_is_not_token_ids_is_refused_by_name_and_nothing_changes(inputs):
    model = small_decoder()
    before = snapshot(model)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    batch = Batch(inputs, torch.zeros(inputs.shape, dtype=torch.long), 4)
    with pytest.raises(EdgetrainError, match=r"mesp: batch 4: inputs must be token ids \[B, T\] \(long\)"):
        METHODS.get("mesp")(model).step(batch, optimizer)
    assert unchanged(model, before)
    assert all(p.grad is None for p in model.parameters())


# -- exact gradients, and what a step applies ----------------------------------------------------------

def test_gradients_equal_bp_with_more_tokens_than_hidden_units_and_chunks_down_to_one():
    # 2 x 19 = 38 tokens > hidden size 24, in ragged chunks and chunks of one (the smallest valid size):
    # every token row of every block is differentiated.
    model = small_decoder()
    batch = token_batch(seq_len=19)
    batch.targets[0, :4] = -100
    ref_loss, ref_grads = METHODS.get("bp")(model).gradients(batch)
    assert all(g.abs().max() > 0 for g in ref_grads.values())
    for options in ({}, dict(attention_chunk=5, mlp_chunk=7, loss_chunk=9),
                    dict(attention_chunk=1, mlp_chunk=1, loss_chunk=1)):
        loss, grads = METHODS.get("mesp")(model, **options).gradients(batch)
        assert abs(loss.item() - ref_loss.item()) <= 1e-6 * abs(ref_loss.item())
        # Not 1e-12: the model's RMSNorm normalises in fp32 even in a float64 model, mesp's in float64.
        assert max_relative_error(ref_grads, grads) <= 1e-6, options


def test_gradients_return_a_non_finite_loss_as_bp_does():
    # gradients() reports the loss, whatever it is (compute_gradients hands it on); only step() refuses it.
    model = small_decoder()
    with torch.no_grad():
        model.head.lm_head.weight[3, 0] = float("inf")
    batch = token_batch()
    bp_loss, _ = METHODS.get("bp")(model).gradients(batch)
    loss, grads = METHODS.get("mesp")(model).gradients(batch)
    assert not torch.isfinite(bp_loss) and not torch.isfinite(loss)
    assert grads.keys() == {n for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("fused", [True, False])
def test_a_step_ignores_stale_gradients_and_leaves_none_behind(fused):
    # A .grad left over from elsewhere must not reach the optimizer: in a fused step every per-block
    # optimizer.step() would otherwise also step the other blocks' adapters (AdamW: their moments, step
    # counts and weight decay). The step equals the one from a clean state, and leaves no .grad.
    results = []
    for stale in (False, True):
        model = small_decoder()
        params = [p for p in model.parameters() if p.requires_grad]
        if stale:
            for p in params:
                p.grad = torch.ones_like(p)
        optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
        method = METHODS.get("mesp")(model, fused_update=fused)
        losses = [method.step(batch, optimizer).item() for batch in (token_batch(seed=0), token_batch(seed=1))]
        assert all(p.grad is None for p in model.parameters())
        steps = sorted(int(state["step"]) for state in optimizer.state.values())
        results.append((losses, steps, {n: p.detach().clone() for n, p in model.named_parameters()}))
    (losses, steps, weights), (stale_losses, stale_steps, stale_weights) = results
    assert steps == stale_steps == [2] * len(steps)
    assert stale_losses == losses
    assert all(torch.equal(stale_weights[n], weights[n]) for n in weights)


def test_a_block_whose_two_norms_use_different_eps_is_refused_and_nothing_changes():
    # The hand-derived block uses one eps for both RMSNorms: a block whose norms differ would get silently
    # wrong gradients, so it is refused with an EdgetrainError before any update.
    model = small_decoder()
    model.blocks[1].post_attention_layernorm.eps = 1e-2
    before = snapshot(model)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    method = METHODS.get("mesp")(model)
    with pytest.raises(EdgetrainError, match="blocks.1: its RMSNorms use different eps"):
        method.step(token_batch(), optimizer)
    assert unchanged(model, before)
    assert all(p.grad is None for p in model.parameters())


# -- the blocks: arguments, buffers, memory ------------------------------------------------------------

def test_block_forward_and_backward_take_their_chunk_options_by_keyword():
    # attention_chunk and mlp_chunk are both ints: keyword-only, so that neither lands in the other's slot;
    # the tensors may be passed by name.
    model = small_decoder()
    weights, x, grad_out, rope = block_inputs(model)
    with torch.no_grad():
        with pytest.raises(TypeError):
            block_forward(weights, x, rope, 3, 5)  # type: ignore[misc]
        with pytest.raises(TypeError):
            block_backward(weights, x, grad_out, rope, 3, 5)  # type: ignore[misc]
        assert torch.equal(block_forward(weights=weights, x=x, rope=rope, attention_chunk=3, mlp_chunk=5),
                           block_forward(weights, x, rope, attention_chunk=3, mlp_chunk=5))
        named, _ = block_backward(weights=weights, x=x, grad_out=grad_out, rope=rope, attention_chunk=3,
                                  mlp_chunk=5)
        positional, _ = block_backward(weights, x, grad_out, rope, attention_chunk=3, mlp_chunk=5)
    assert torch.equal(named, positional)


@pytest.mark.parametrize("bad", [0, -1, 2.5])
def test_block_forward_and_backward_refuse_chunk_sizes_that_are_not_positive_integers(bad):
    # A negative mlp_chunk would make range() empty and skip the MLP without a word.
    model = small_decoder()
    weights, x, grad_out, rope = block_inputs(model)
    with torch.no_grad():
        for name in ("attention_chunk", "mlp_chunk"):
            chunks = {"attention_chunk": 3, "mlp_chunk": 5, name: bad}
            with pytest.raises(ValueError, match=f"{name} must be a positive integer"):
                block_forward(weights, x, rope, **chunks)
            with pytest.raises(ValueError, match=f"{name} must be a positive integer"):
                block_backward(weights, x, grad_out.clone(), rope, **chunks)


def test_block_backward_leaves_grad_out_untouched_unless_told_to_consume_it():
    model = small_decoder()
    weights, x, grad_out, rope = block_inputs(model)
    original = grad_out.clone()
    with torch.no_grad():
        kept_x, kept_grads = block_backward(weights, x, grad_out, rope, attention_chunk=3, mlp_chunk=5)
        assert torch.equal(grad_out, original)  # the default: grad_out is only read
        assert kept_x.data_ptr() != grad_out.data_ptr()
        # overwrite_grad_out=True: dL/dx is written into grad_out's buffer (one [B, T, D] buffer less),
        # and it is the same dL/dx.
        consumed = original.clone()
        grad_x, grads = block_backward(weights, x, consumed, rope, attention_chunk=3, mlp_chunk=5,
                                       overwrite_grad_out=True)
    assert grad_x.data_ptr() == consumed.data_ptr()
    assert torch.equal(grad_x, kept_x)
    assert grads.keys() == kept_grads.keys() and all(torch.equal(grads[k], kept_grads[k]) for k in grads)


def test_the_backward_walk_keeps_one_residual_gradient_buffer_for_all_blocks(monkeypatch):
    # Each block's dL/dx is written into the buffer that held dL/d(its output): the residual stream's
    # gradient is one [B, T, D] buffer from the loss to the embedding, never one per block.
    model = small_decoder(num_hidden_layers=3)
    import edgetrain.methods.mesp.compiled as mesp_programs  # where a step takes its block programs from

    real_backward, buffers = mesp_programs.block_backward, []

    def recording(weights, x, grad_out, rope, **kwargs):
        grad_x, grads = real_backward(weights, x, grad_out, rope, **kwargs)
        buffers.append((grad_out.data_ptr(), grad_x.data_ptr()))
        return grad_x, grads

    monkeypatch.setattr(mesp_programs, "block_backward", recording)
    METHODS.get("mesp")(model).gradients(token_batch())
    assert len(buffers) == 3
    assert len({pointer for pair in buffers for pointer in pair}) == 1


@pytest.mark.parametrize("store,computed", [(None, 7), (False, 7), (True, 4)])
def test_lora_projections_are_recomputed_for_the_gradient_unless_stored(monkeypatch, store, computed):
    # x @ A^T (one fused matmul per group of projections reading the same input: q/k/v, o, gate/up, down)
    # is recomputed where its gradient needs it -- the MeSP insight -- unless store_lora_projection keeps
    # the one the block's recomputed forward made (the paper's Table 5). One MLP chunk: the forward makes
    # q/k/v, o and gate/up; down's is made once either way; recomputing adds q/k/v, o and gate/up again.
    # The gradients are the same either way.
    model = small_decoder()
    weights, x, grad_out, rope = block_inputs(model)
    real_projection, calls = mesp_ops.lora_projection, []

    def counting(inputs, linears):
        calls.append(len(linears))
        return real_projection(inputs, linears)

    option = {} if store is None else dict(store_lora_projection=store)  # None: the default, recomputed
    with torch.no_grad():
        reference = block_backward(weights, x, grad_out, rope, attention_chunk=3, mlp_chunk=64,
                                   store_lora_projection=not store)
        monkeypatch.setattr(mesp_ops, "lora_projection", counting)
        grad_x, grads = block_backward(weights, x, grad_out, rope, attention_chunk=3, mlp_chunk=64, **option)
    assert len(calls) == computed, calls
    assert torch.allclose(grad_x, reference[0], rtol=0, atol=1e-12)
    assert all(torch.allclose(grads[k], reference[1][k], rtol=0, atol=1e-12) for k in grads)


def test_the_mlp_runs_in_chunk_sized_buffers_that_it_consumes():
    # method.py: the MLP's temporaries are four [mlp_chunk, intermediate] buffers in the backward (the SiLU
    # backward consumes gate, up and dL/dactivation: three in, two out, one sigmoid temporary), and the
    # forward computes silu(gate) * up in gate's buffer (two). A wide MLP (intermediate 1024, hidden 16,
    # 32 tokens) makes those buffers dominate; everything else here (the MLP adapters' [1024, rank]
    # gradients included) adds less than one more (0.55 in the backward, 0.07 in the forward).
    model = small_decoder(hidden_size=16, num_attention_heads=4, num_key_value_heads=2, head_dim=4,
                          intermediate_size=1024)
    weights, x, grad_out, rope = block_inputs(model, seq_len=16)
    chunk = 16
    buffer = chunk * 1024 * x.element_size()
    with torch.no_grad():
        with TensorAccountant() as backward:
            block_backward(weights, x, grad_out, rope, attention_chunk=16, mlp_chunk=chunk)
        with TensorAccountant() as forward:
            block_forward(weights, x, rope, attention_chunk=16, mlp_chunk=chunk)
    assert backward.report().peak_above_baseline_bytes <= 5 * buffer
    assert forward.report().peak_above_baseline_bytes <= 2.5 * buffer


# -- the ops -------------------------------------------------------------------------------------------

def test_linear_weights_without_an_adapter_have_rank_zero_and_an_adapter_defaults_to_scale_one():
    torch.manual_seed(0)
    weight, lora_A, lora_B = (torch.randn(*shape, dtype=torch.float64) for shape in ((4, 5), (3, 5), (4, 3)))
    plain = LinearWeights(weight)
    assert not plain.has_lora and plain.rank == 0
    adapted = LinearWeights(weight, None, lora_A, lora_B)
    assert adapted.has_lora and adapted.rank == 3
    x = torch.randn(6, 5, dtype=torch.float64)
    (y,), _ = linear_group_forward(x, [adapted])
    assert torch.allclose(y, x @ weight.t() + x @ lora_A.t() @ lora_B.t(), atol=1e-12)


def test_lora_gradients_need_both_adapter_halves():
    torch.manual_seed(0)
    weight, lora_A, lora_B = (torch.randn(*shape, dtype=torch.float64) for shape in ((4, 5), (3, 5), (4, 3)))
    for linear in (LinearWeights(weight), LinearWeights(weight, None, lora_A, None),
                   LinearWeights(weight, None, None, lora_B)):
        with pytest.raises(ValueError, match="no LoRA gradients"):
            LoRAGradients.zeros_like(linear, torch.float64)
    grads = LoRAGradients.zeros_like(LinearWeights(weight, None, lora_A, lora_B))
    assert grads.lora_A.shape == lora_A.shape and grads.lora_B.shape == lora_B.shape
    assert not grads.lora_A.any() and not grads.lora_B.any()


def test_lora_gradient_accumulators_take_the_requested_wider_dtype():
    # block_backward accumulates a bf16 model's LoRA gradients in fp32 (rounded once, at the end): the
    # accumulators are made in the dtype asked for, and in the adapter's own dtype when none is asked.
    torch.manual_seed(0)
    weight, lora_A, lora_B = (torch.randn(*shape, dtype=torch.bfloat16) for shape in ((4, 5), (3, 5), (4, 3)))
    linear = LinearWeights(weight, None, lora_A, lora_B, 0.5)
    wide = LoRAGradients.zeros_like(linear, torch.float32)
    assert (wide.lora_A.dtype, wide.lora_B.dtype) == (torch.float32, torch.float32)
    own = LoRAGradients.zeros_like(linear)
    assert (own.lora_A.dtype, own.lora_B.dtype) == (torch.bfloat16, torch.bfloat16)


def test_accumulate_matmul_adds_the_product_into_the_accumulator_in_its_own_dtype():
    torch.manual_seed(0)
    left, right = torch.randn(3, 4, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
    start = torch.randn(3, 2, dtype=torch.float64)
    same = start.clone()
    accumulate_matmul(same, left, right)  # alpha defaults to 1
    assert torch.allclose(same, start + left @ right, rtol=0, atol=1e-12)
    accumulate_matmul(same, left, right, alpha=-0.5)
    assert torch.allclose(same, start + 0.5 * left @ right, rtol=0, atol=1e-12)
    wide = start.float()  # a wider accumulator than the operands: the bf16 model's fp32 gradients
    accumulate_matmul(wide, left.bfloat16(), right.bfloat16())
    assert wide.dtype == torch.float32
    assert torch.allclose(wide, start.float() + (left.bfloat16() @ right.bfloat16()).float(), rtol=0, atol=1e-6)


def test_attention_refuses_keys_and_values_of_different_shapes():
    # v with one head against k with two would broadcast in the matmul and silently share that one head.
    torch.manual_seed(0)
    q, k = torch.randn(1, 4, 5, 4, dtype=torch.float64), torch.randn(1, 2, 5, 4, dtype=torch.float64)
    for v in (torch.randn(1, 1, 5, 4, dtype=torch.float64), torch.randn(1, 2, 5, 3, dtype=torch.float64),
              torch.randn(2, 5, 4, dtype=torch.float64)):
        with pytest.raises(ValueError, match="attention expects"):
            causal_attention_forward(q, k, v, 2)
        with pytest.raises(ValueError, match="attention expects"):
            causal_attention_backward(q, k, v, torch.zeros_like(q), torch.ones_like(q), 2)


# -- the chunked loss ----------------------------------------------------------------------------------

@pytest.mark.parametrize("seq_len", [5, 0])
def test_chunked_loss_refuses_a_non_positive_vocabulary_tile_even_without_tokens(seq_len):
    hidden = torch.randn(2, seq_len, 6, dtype=torch.float64)
    targets = torch.zeros(2, seq_len, dtype=torch.long)
    norm_weight, lm_weight = torch.ones(6, dtype=torch.float64), torch.randn(11, 6, dtype=torch.float64)
    for vocab_chunk in (0, -1):
        with pytest.raises(ValueError, match=f"must be positive, got chunk=3, vocab_chunk={vocab_chunk}"):
            chunked_lm_loss(hidden, norm_weight, 1e-6, lm_weight, targets, 3, vocab_chunk)


def test_chunked_loss_is_the_same_for_every_tile_size_down_to_one_token_and_one_vocabulary_row():
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 5, 6, generator=generator, dtype=torch.float64)
    targets = torch.randint(0, 11, (2, 5), generator=generator)
    targets[0, 1] = -100
    norm_weight = torch.rand(6, generator=generator, dtype=torch.float64) + 0.5
    lm_weight = torch.randn(11, 6, generator=generator, dtype=torch.float64)
    whole_loss, whole_grad = chunked_lm_loss(hidden, norm_weight, 1e-6, lm_weight, targets, 10, 11)
    for chunk, vocab_chunk in ((1, 1), (3, 1), (1, 4), (10, 1)):
        loss, grad = chunked_lm_loss(hidden, norm_weight, 1e-6, lm_weight, targets, chunk, vocab_chunk)
        assert torch.allclose(loss, whole_loss, rtol=1e-12, atol=0), (chunk, vocab_chunk)
        assert torch.allclose(grad, whole_grad, rtol=1e-10, atol=1e-14), (chunk, vocab_chunk)


@pytest.mark.parametrize("gap", [0.0, 0.5, 29.5, 30.0, 30.5, 70.0])
def test_chunked_loss_of_a_token_is_exact_however_far_its_target_is_below_the_max_logit(gap):
    # The loss switches between log1p(sum_{v != t} exp(l_v - l_t)) and gap + log(sum exp(l - max)) at a
    # gap of 30: both sides of the switch are the exact cross-entropy.
    norm_weight = torch.ones(2, dtype=torch.float64)
    hidden = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    scale = rms_norm_forward(hidden, norm_weight, 1e-6)[0, 0]
    logits = torch.tensor([0.0, -0.5, -gap, -gap - 1.0, -100.0], dtype=torch.float64)
    lm_weight = torch.stack([logits / scale, torch.zeros_like(logits)], dim=1)
    target = torch.tensor([2])
    reference = F.cross_entropy((rms_norm_forward(hidden, norm_weight, 1e-6) @ lm_weight.t()), target)
    assert gap <= reference.item() <= gap + 1.2  # the target really is `gap` below the max
    for vocab_chunk in (5, 2):
        loss, _ = chunked_lm_loss(hidden, norm_weight, 1e-6, lm_weight, target, 1, vocab_chunk)
        assert torch.allclose(loss, reference, rtol=1e-12, atol=0), (loss.item(), reference.item())


def test_chunked_loss_of_a_one_token_vocabulary_with_ignored_positions():
    # LlamaConfig allows vocab_size=1: ignored positions must not be looked up beyond the vocabulary.
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 3, 4, generator=generator, dtype=torch.float64)
    targets = torch.zeros(2, 3, dtype=torch.long)
    targets[0, 1] = -100
    lm_weight = torch.randn(1, 4, generator=generator, dtype=torch.float64)
    loss, grad = chunked_lm_loss(hidden, torch.ones(4, dtype=torch.float64), 1e-6, lm_weight, targets, 2, 4)
    assert loss.item() == 0.0  # one class: probability 1
    assert not grad.any()


def test_swiglu_ops_leave_their_inputs_alone_unless_told_to_consume_them():
    # swiglu_forward / swiglu_backward overwrite their inputs only with overwrite_inputs=True (what the
    # block code passes, to save buffers); a caller who does not ask keeps gate, up and grad_out.
    generator = torch.Generator().manual_seed(0)
    gate, up, grad_out = (torch.randn(3, 5, generator=generator, dtype=torch.float64) for _ in range(3))
    kept = [t.clone() for t in (gate, up, grad_out)]
    activation = mesp_ops.swiglu_forward(gate, up)
    grad_gate, grad_up = mesp_ops.swiglu_backward(gate, up, grad_out)
    assert all(torch.equal(t, k) for t, k in zip((gate, up, grad_out), kept))
    assert torch.allclose(activation, F.silu(kept[0]) * kept[1])
    assert torch.allclose(grad_up, kept[2] * F.silu(kept[0]))
    assert grad_gate.data_ptr() not in {t.data_ptr() for t in (gate, up, grad_out)}
