"""MeSP's hand-derived backward passes, op by op, against numerical gradients (gradcheck, float64).

Each op's forward/backward pair is wrapped in an autograd.Function, so gradcheck compares the
hand-written backward (the analytic side) with finite differences of the hand-written forward;
the forwards are checked against the model's own modules separately.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.autograd import gradcheck
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from edgetrain.training.losses import lm_loss
from edgetrain.methods.mesp.loss import chunked_lm_loss
from edgetrain.methods.mesp.ops import (LinearWeights, LoRAGradients, causal_attention_backward,
                                        causal_attention_forward, linear_group_backward, linear_group_forward,
                                        rms_norm_backward, rms_norm_forward, rope_backward, rope_forward,
                                        swiglu_backward, swiglu_forward)
from edgetrain.models.llama import LlamaConfig, RMSNorm, apply_rope, rope_cos_sin

DOUBLE = dict(dtype=torch.float64)


def randn(*shape: int, requires_grad: bool = True) -> torch.Tensor:
    return torch.randn(*shape, **DOUBLE).requires_grad_(requires_grad)


# -- RMSNorm -----------------------------------------------------------------------------------------

class RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return rms_norm_forward(x, weight, eps)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        return rms_norm_backward(x, weight, ctx.eps, grad), None, None


def test_rms_norm_backward_gradcheck():
    torch.manual_seed(0)
    x, weight = randn(3, 5, 8), randn(8, requires_grad=False)
    assert gradcheck(lambda t: RMSNormFn.apply(t, weight, 1e-6), (x,))


def test_rms_norm_forward_and_backward_match_the_model_module_in_fp32_and_bf16():
    torch.manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 2e-2)):
        norm = RMSNorm(16, 1e-6).to(dtype)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(16))
        norm.weight.requires_grad_(False)
        x = torch.randn(4, 16, dtype=dtype, requires_grad=True)
        grad = torch.randn(4, 16, dtype=dtype)
        reference = norm(x)
        reference.backward(grad)
        assert torch.equal(rms_norm_forward(x.detach(), norm.weight, 1e-6), reference.detach())
        mine = rms_norm_backward(x.detach(), norm.weight, 1e-6, grad)
        assert mine.dtype == dtype
        assert ((mine.float() - x.grad.float()).abs().max() / x.grad.float().abs().max()) <= tol


# -- RoPE --------------------------------------------------------------------------------------------

class RopeFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return rope_forward(x, cos, sin)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return rope_backward(grad, cos, sin), None, None


def test_rope_backward_is_the_inverse_rotation_and_passes_gradcheck():
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2)
    cos, sin = rope_cos_sin(config, 6, torch.device("cpu"), torch.float64)
    x = randn(2, 4, 6, 8)
    assert torch.equal(rope_forward(x.detach(), cos, sin), apply_rope(x.detach(), cos, sin))
    assert gradcheck(lambda t: RopeFn.apply(t, cos, sin), (x,))
    # A rotation's inverse is its transpose: the backward undoes the forward.
    assert torch.allclose(rope_backward(rope_forward(x.detach(), cos, sin), cos, sin), x.detach(), atol=1e-12)


# -- attention ---------------------------------------------------------------------------------------

class AttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, chunk):
        out = causal_attention_forward(q, k, v, chunk)
        ctx.save_for_backward(q, k, v, out)
        ctx.chunk = chunk
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out = ctx.saved_tensors
        return (*causal_attention_backward(q, k, v, out, grad, ctx.chunk), None)


@pytest.mark.parametrize("heads,kv_heads,seq_len,chunk", [(4, 2, 7, 3), (3, 3, 5, 1), (6, 2, 5, 16), (2, 1, 9, 4)])
def test_attention_forward_matches_sdpa_and_backward_passes_gradcheck(heads, kv_heads, seq_len, chunk):
    torch.manual_seed(0)
    q, k, v = randn(2, heads, seq_len, 4), randn(2, kv_heads, seq_len, 4), randn(2, kv_heads, seq_len, 4)
    reference = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=heads != kv_heads)
    assert torch.allclose(causal_attention_forward(q.detach(), k.detach(), v.detach(), chunk), reference,
                          atol=1e-12)
    assert gradcheck(lambda a, b, c: AttentionFn.apply(a, b, c, chunk), (q, k, v))


def test_attention_in_bf16_runs_its_softmax_in_fp32_and_returns_bf16():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, 12, 8, dtype=torch.bfloat16) for _ in range(3))
    k, v = k[:, :2], v[:, :2]
    out = causal_attention_forward(q, k, v, 5)
    reference = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, enable_gqa=True)
    assert out.dtype == torch.bfloat16
    assert (out.float() - reference).abs().max() < 2e-2
    grads = causal_attention_backward(q, k, v, out, torch.randn_like(out), 5)
    assert [g.dtype for g in grads] == [torch.bfloat16] * 3


class LargestOutput(TorchDispatchMode):
    """Records the element count of the largest tensor any op produces."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_chunked_attention_never_builds_the_full_score_matrix():
    torch.manual_seed(0)
    heads, seq_len, chunk = 4, 64, 8
    q, k, v = torch.randn(1, heads, seq_len, 8), torch.randn(1, 2, seq_len, 8), torch.randn(1, 2, seq_len, 8)
    with LargestOutput() as probe:
        out = causal_attention_forward(q, k, v, chunk)
        causal_attention_backward(q, k, v, out, torch.randn_like(out), chunk)
    assert probe.largest <= heads * chunk * seq_len < heads * seq_len * seq_len


# -- SwiGLU ------------------------------------------------------------------------------------------

class SwiGLUFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, overwrite):
        ctx.save_for_backward(gate, up)
        ctx.overwrite = overwrite
        return swiglu_forward(gate, up)

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        if ctx.overwrite:  # the function may consume all three
            gate, up, grad = gate.clone(), up.clone(), grad.clone()
        return (*swiglu_backward(gate, up, grad, overwrite_inputs=ctx.overwrite), None)


@pytest.mark.parametrize("overwrite", [False, True])
def test_swiglu_backward_gradcheck(overwrite):
    torch.manual_seed(0)
    gate, up = randn(4, 6) * 3, randn(4, 6)
    gate = gate.detach().requires_grad_()
    assert gradcheck(lambda g, u: SwiGLUFn.apply(g, u, overwrite), (gate, up))


# -- LoRA linears --------------------------------------------------------------------------------------

class LinearGroupFn(torch.autograd.Function):
    """Three linears reading one input: LoRA (with bias), plain (frozen), LoRA (another rank)."""

    @staticmethod
    def forward(ctx, x, a1, b1, a2, b2, frozen, store):
        ctx.frozen, ctx.store = frozen, store
        linears = _group(frozen, a1, b1, a2, b2)
        outputs, projection = linear_group_forward(x, linears)
        ctx.save_for_backward(x, a1, b1, a2, b2, projection if store else None)
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads):
        x, a1, b1, a2, b2, projection = ctx.saved_tensors
        linears = _group(ctx.frozen, a1, b1, a2, b2)
        accumulators = [LoRAGradients.zeros_like(linears[0]), None, LoRAGradients.zeros_like(linears[2])]
        grad_x = linear_group_backward(x, linears, grads, accumulators, projection=projection)
        return (grad_x, accumulators[0].lora_A, accumulators[0].lora_B, accumulators[2].lora_A,
                accumulators[2].lora_B, None, None)


def _group(frozen, a1, b1, a2, b2):
    w1, bias1, w2, w3 = frozen
    return [LinearWeights(w1, bias1, a1, b1, 0.5), LinearWeights(w2), LinearWeights(w3, None, a2, b2, 2.0)]


@pytest.mark.parametrize("store", [False, True])
def test_lora_linear_group_backward_gradcheck(store):
    torch.manual_seed(0)
    d_in = 5
    frozen = (randn(4, d_in, requires_grad=False), randn(4, requires_grad=False),
              randn(3, d_in, requires_grad=False), randn(6, d_in, requires_grad=False))
    x, a1, b1, a2, b2 = randn(7, d_in), randn(2, d_in), randn(4, 2), randn(3, d_in), randn(6, 3)
    assert gradcheck(lambda *t: LinearGroupFn.apply(*t, frozen, store), (x, a1, b1, a2, b2))


def test_lora_linear_forward_matches_the_module_formula_and_gradients_accumulate_over_row_chunks():
    torch.manual_seed(0)
    weight, bias = torch.randn(6, 5, **DOUBLE), torch.randn(6, **DOUBLE)
    lora_A, lora_B = torch.randn(3, 5, **DOUBLE), torch.randn(6, 3, **DOUBLE)
    linear = LinearWeights(weight, bias, lora_A, lora_B, 0.25)
    x, grad = torch.randn(10, 5, **DOUBLE), torch.randn(10, 6, **DOUBLE)
    (y,), _ = linear_group_forward(x, [linear])
    assert torch.allclose(y, F.linear(x, weight, bias) + (x @ lora_A.t() @ lora_B.t()) * 0.25, atol=1e-12)
    whole = LoRAGradients.zeros_like(linear)
    linear_group_backward(x, [linear], [grad], [whole])
    pieces = LoRAGradients.zeros_like(linear)
    for rows in (slice(0, 3), slice(3, 10)):
        linear_group_backward(x[rows], [linear], [grad[rows]], [pieces], need_grad_input=False)
    assert torch.allclose(whole.lora_A, pieces.lora_A, atol=1e-12)
    assert torch.allclose(whole.lora_B, pieces.lora_B, atol=1e-12)


# -- chunked LM loss -----------------------------------------------------------------------------------

class ChunkedLossFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, norm_weight, lm_weight, targets, chunk, vocab_chunk):
        loss, grad = chunked_lm_loss(hidden, norm_weight, 1e-6, lm_weight, targets, chunk, vocab_chunk)
        ctx.save_for_backward(grad)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        (grad,) = ctx.saved_tensors
        return grad * grad_loss, None, None, None, None, None


def _loss_inputs(dtype=torch.float64, vocab=11, batch=2, seq_len=5, dim=6):
    hidden = torch.randn(batch, seq_len, dim, dtype=dtype, requires_grad=True)
    norm_weight = (torch.rand(dim, dtype=dtype) + 0.5)
    lm_weight = torch.randn(vocab, dim, dtype=dtype)
    targets = torch.randint(0, vocab, (batch, seq_len))
    targets[0, 1] = targets[1, 4] = -100
    return hidden, norm_weight, lm_weight, targets


@pytest.mark.parametrize("chunk,vocab_chunk", [(3, 4), (10, 64)])
def test_chunked_loss_gradient_gradcheck_with_ignored_targets_and_ragged_tiles(chunk, vocab_chunk):
    torch.manual_seed(0)
    hidden, norm_weight, lm_weight, targets = _loss_inputs()
    assert gradcheck(lambda h: ChunkedLossFn.apply(h, norm_weight, lm_weight, targets, chunk, vocab_chunk),
                     (hidden,))


def _reference_loss(hidden, norm_weight, lm_weight, targets):
    norm = RMSNorm(hidden.shape[-1], 1e-6).to(hidden.dtype)
    with torch.no_grad():
        norm.weight.copy_(norm_weight)
    norm.weight.requires_grad_(False)
    reference = lm_loss(norm(hidden) @ lm_weight.t(), targets)
    reference.backward()
    return reference


@pytest.mark.parametrize("chunk,vocab_chunk", [(1, 50), (4, 7), (64, 4096)])
def test_chunked_loss_equals_lm_loss_over_the_full_logits(chunk, vocab_chunk):
    torch.manual_seed(0)
    hidden, norm_weight, lm_weight, targets = _loss_inputs(torch.float32, vocab=50, seq_len=9)
    reference = _reference_loss(hidden, norm_weight, lm_weight, targets)
    loss, grad = chunked_lm_loss(hidden.detach(), norm_weight, 1e-6, lm_weight, targets, chunk, vocab_chunk)
    assert loss.dtype == torch.float32
    assert abs(loss.item() - reference.item()) <= 1e-6 * abs(reference.item())
    assert ((grad - hidden.grad).abs().max() / hidden.grad.abs().max()) <= 1e-5


@pytest.mark.parametrize("scale", [3.0, 6.0])
def test_chunked_loss_stays_accurate_in_fp32_when_the_target_is_nearly_certain(scale):
    # p_target ~ 1: loss and gradient are small differences that must not drown in rounding.
    # Reference: the same function in fp64 (fp32 autograd itself is off by 1e-2 at scale 6).
    torch.manual_seed(0)
    dim, vocab = 32, 50
    lm_weight = torch.randn(vocab, dim, **DOUBLE) / dim ** 0.5 * scale
    targets = torch.randint(0, vocab, (2, 9))
    hidden = (lm_weight[targets] + 0.01 * torch.randn(2, 9, dim, **DOUBLE)).requires_grad_()
    norm_weight = torch.ones(dim, **DOUBLE)
    logits = rms_norm_forward(hidden, norm_weight, 1e-6) @ lm_weight.t()
    reference = F.cross_entropy(logits.flatten(0, 1), targets.flatten())  # fp64 (lm_loss would round to fp32)
    reference.backward()
    assert reference.item() < 1e-2
    loss, grad = chunked_lm_loss(hidden.detach().float(), norm_weight.float(), 1e-6, lm_weight.float(), targets, 4, 7)
    assert abs(loss.item() - reference.item()) <= 1e-5 * abs(reference.item())
    assert ((grad.double() - hidden.grad).abs().max() / hidden.grad.abs().max()) <= 1e-5


def test_chunked_loss_rejects_mismatched_targets_and_bad_chunks():
    hidden, norm_weight, lm_weight, targets = _loss_inputs()
    with pytest.raises(ValueError, match="do not match"):
        chunked_lm_loss(hidden.detach(), norm_weight, 1e-6, lm_weight, targets[:, :3], 2)
    with pytest.raises(ValueError, match="positive"):
        chunked_lm_loss(hidden.detach(), norm_weight, 1e-6, lm_weight, targets, 0)
