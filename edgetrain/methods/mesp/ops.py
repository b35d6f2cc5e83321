"""Hand-derived forward and backward passes of a decoder block's pieces (MeSP paper, Appendix A).

Plain tensor functions: no autograd graph is built or used, so the caller decides exactly which
tensors live and for how long. Every backward recomputes what it needs from the inputs it is given
(RMSNorm's 1/rms, the attention probabilities, SiLU's sigmoid, LoRA's x @ A^T) instead of relying on
anything stored by the forward.

Precision follows the model code: RMSNorm normalises and attention's softmax runs in
edgetrain.training.precision.compute_dtype (fp32 for fp32 and low-precision inputs, fp64 for fp64 ones, as
the model's own RMSNorm and loss), everything else runs in the input dtype. Gradient accumulators handed in by
the caller may be wider than the inputs (fp32 for a bf16 model): partial products are added into
them, never rounded back in between.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F

import edgetrain.training.precision as precision
from edgetrain.methods.mesp import step_buffers

# Each function below that allocates a large temporary asks step_buffers for it. Outside a step (a traced
# export, a unit test) there is no pool and the plain expression runs; inside, the same arithmetic writes into
# a reused buffer (the `out=` forms), so both give the same numbers bit for bit.


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half-precision inputs (softmax and reductions lose too much in bf16), else unchanged."""
    return precision.compute_dtype(dtype)


def matmul(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """left @ right (2-D, or batched with equal batch shapes), written into a reused buffer inside a step."""
    out = step_buffers.empty((*left.shape[:-1], right.shape[-1]), left.dtype, left.device)
    return left @ right if out is None else torch.matmul(left, right, out=out)


def contiguous(tensor: torch.Tensor) -> torch.Tensor:
    """tensor.contiguous(), the copy (when one is needed) into a reused buffer inside a step."""
    if tensor.is_contiguous():
        return tensor
    out = step_buffers.empty(tensor.shape, tensor.dtype, tensor.device)
    return tensor.contiguous() if out is None else out.copy_(tensor)


def accumulate_matmul(accumulator: torch.Tensor, left: torch.Tensor, right: torch.Tensor,
                      alpha: float = 1.0) -> None:
    """accumulator += alpha * left @ right, without a temporary when the dtypes agree."""
    if accumulator.dtype == left.dtype:
        accumulator.addmm_(left, right, alpha=alpha)
    else:
        accumulator.add_(left @ right, alpha=alpha)


# -- RMSNorm ---------------------------------------------------------------------------------------

def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x / rms(x)), the normalisation in compute_dtype (as the model's RMSNorm) and rounded to
    x's dtype before the weight."""
    work_dtype = precision.compute_dtype(x.dtype, weight.dtype)
    out = step_buffers.empty(x.shape, x.dtype, x.device) if x.dtype == work_dtype == weight.dtype else None
    if out is None:
        work = x.to(work_dtype)
        normed = work * torch.rsqrt(work.pow(2).mean(-1, keepdim=True) + eps)
        return weight * normed.to(x.dtype)
    inverse_rms = torch.rsqrt(torch.pow(x, 2, out=out).mean(-1, keepdim=True) + eps)
    return torch.mul(x, inverse_rms, out=out).mul_(weight)  # weight * normed, one buffer


def rms_norm_backward(x: torch.Tensor, weight: torch.Tensor, eps: float,
                      grad_out: torch.Tensor) -> torch.Tensor:
    """dL/dx of rms_norm_forward (the weight is frozen: no weight gradient).

    With r = 1/rms(x) and n = x r:  dx = r (g - n mean(g n)),  g = weight * dL/dy.
    """
    work_dtype = precision.compute_dtype(x.dtype, weight.dtype)
    if x.dtype == work_dtype == weight.dtype == grad_out.dtype and step_buffers.active() is not None:
        return _rms_norm_backward_in_buffers(x, weight, eps, grad_out)
    x32 = x.to(work_dtype)
    inv_rms = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    grad_normed = (grad_out * weight).to(work_dtype)
    normed = x32.mul_(inv_rms) if x32 is not x else x32 * inv_rms
    projection = (grad_normed * normed).mean(-1, keepdim=True)
    grad_x = grad_normed.sub_(normed.mul_(projection)).mul_(inv_rms)
    return grad_x.to(x.dtype)


def _rms_norm_backward_in_buffers(x: torch.Tensor, weight: torch.Tensor, eps: float,
                                  grad_out: torch.Tensor) -> torch.Tensor:
    """rms_norm_backward's arithmetic for one dtype throughout, in three reused buffers."""
    normed = step_buffers.empty(x.shape, x.dtype, x.device)
    inverse_rms = torch.rsqrt(torch.pow(x, 2, out=normed).mean(-1, keepdim=True) + eps)
    grad_normed = torch.mul(grad_out, weight, out=step_buffers.empty(x.shape, x.dtype, x.device))
    torch.mul(x, inverse_rms, out=normed)
    products = torch.mul(grad_normed, normed, out=step_buffers.empty(x.shape, x.dtype, x.device))
    projection = products.mean(-1, keepdim=True)
    del products
    return grad_normed.sub_(normed.mul_(projection)).mul_(inverse_rms)


# -- RoPE ------------------------------------------------------------------------------------------

def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def rope_forward(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE: x cos + rotate_half(x) sin, with cos/sin [T, head_dim] broadcast over heads."""
    out = step_buffers.empty(x.shape, x.dtype, x.device) if x.dtype == cos.dtype == sin.dtype else None
    if out is None:
        return x * cos + rotate_half(x) * sin
    return _rotate_in_buffer(out, x, cos, sin, sign=-1)


def rope_backward(grad_out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE is a rotation per position, so its backward is the rotation by -theta."""
    same_dtype = grad_out.dtype == cos.dtype == sin.dtype
    out = step_buffers.empty_like(grad_out) if same_dtype else None
    if out is None:
        return grad_out * cos - rotate_half(grad_out) * sin
    return _rotate_in_buffer(out, grad_out, cos, sin, sign=1)


def _rotate_in_buffer(out: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      sign: int) -> torch.Tensor:
    """x cos - sign rotate_half(x) sin written into `out` half by half, with one half-sized temporary: first
    half x1 c1 + sign x2 s1, second half x2 c2 - sign x1 s2 (sign -1: rope_forward, +1: rope_backward). Each
    product is rounded alone and then added, as in the plain form (negating is exact): the same bits."""
    half = x.shape[-1] // 2
    x1, x2, out1, out2 = x[..., :half], x[..., half:], out[..., :half], out[..., half:]
    product = step_buffers.empty(x1.shape, x.dtype, x.device)
    torch.mul(x1, cos[..., :half], out=out1)
    torch.mul(x2, sin[..., :half], out=product)
    if sign > 0:
        out1.add_(product)
    else:
        out1.sub_(product)
    torch.mul(x2, cos[..., half:], out=out2)
    torch.mul(x1, sin[..., half:], out=product)
    if sign > 0:
        out2.sub_(product)
    else:
        out2.add_(product)
    return out


# -- grouped-query causal attention ------------------------------------------------------------------

def _query_chunk(q: torch.Tensor, start: int, stop: int, groups: int) -> torch.Tensor:
    """Rows start:stop of q [B, H, T, hd] as [B, KV, G*C, hd]: the G query heads that share a KV head
    become one batch of rows, so one matmul against that KV head serves them all (no repeated K/V)."""
    batch, heads, _, head_dim = q.shape
    rows, kv_heads = stop - start, heads // groups
    rows_of_q = q[:, :, start:stop]
    out = None if rows_of_q.is_contiguous() else step_buffers.empty((batch, kv_heads, groups * rows, head_dim),
                                                                      q.dtype, q.device)
    if out is None:
        return rows_of_q.reshape(batch, kv_heads, groups * rows, head_dim)
    out.view(batch, kv_heads, groups, rows, head_dim).copy_(rows_of_q.view(batch, kv_heads, groups, rows, head_dim))
    return out


def _sequence_major_empty(batch: int, heads: int, groups: int, seq_len: int, head_dim: int,
                          dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """An uninitialised [B, H, T, hd] result laid out as [B, T, H, hd] in memory -- so that
    .transpose(1, 2).reshape(B*T, H*hd), the o_proj input, is a free view -- and the same memory
    seen as [B, KV, G, T, hd] for writing query-chunk results."""
    shape = (batch, seq_len, heads // groups, groups, head_dim)
    storage = step_buffers.empty(shape, dtype, device)
    if storage is None:
        storage = torch.empty(shape, dtype=dtype, device=device)
    return storage.view(batch, seq_len, heads, head_dim).transpose(1, 2), storage.permute(0, 2, 3, 1, 4)


def _causal_probabilities(q_chunk: torch.Tensor, keys: torch.Tensor, start: int, stop: int,
                          groups: int, scale: float, window: int | None = None) -> torch.Tensor:
    """softmax(q k^T * scale) with the causal mask, for query rows start:stop against keys 0:stop (with a
    sliding `window`, query p sees keys p - window + 1 .. p only).
    Returned shape [B, KV, G*C, stop]; computed in place on the one score buffer."""
    scores = matmul(q_chunk, keys.transpose(-1, -2)).mul_(scale)
    rows = stop - start
    if window is not None and start - window + rows - 1 >= 0:  # some query of the chunk has keys too old to see
        queries = torch.arange(start, stop, device=scores.device)[:, None]
        too_old = torch.arange(stop, device=scores.device)[None, :] <= queries - window
        batch, kv_heads = scores.shape[:2]
        scores.view(batch, kv_heads, groups, rows, stop).masked_fill_(too_old, float("-inf"))
    if rows > 1:
        # Query at position start+i may see keys 0..start+i: only the last `rows` key columns need a mask.
        positions = torch.arange(rows, device=scores.device)
        future = positions.unsqueeze(0) > positions.unsqueeze(1)  # (bool triu_ is oddly slow on CPU)
        batch, kv_heads = scores.shape[:2]
        by_group = scores.view(batch, kv_heads, groups, rows, stop)
        if torch.compiler.is_exporting():
            # A traced program (edgetrain/export/mesp_graph.py) adds the mask, 0 or -inf, over the whole window:
            # one broadcast add XNNPACK runs, where this slice's in-place fill traces to ExecuTorch's portable
            # `where` (8 ns an element) and a slice write. x + 0 = x and x + -inf = -inf: the same softmax.
            bias = torch.where(future, float("-inf"), 0.0).to(scores.dtype)
            if start:
                bias = torch.cat([bias.new_zeros(rows, start), bias], dim=1)
            scores = (by_group + bias).view(scores.shape)
        else:
            by_group[..., start:].masked_fill_(future, float("-inf"))
    scores.sub_(scores.amax(-1, keepdim=True)).exp_()
    return scores.div_(scores.sum(-1, keepdim=True))


def _check_attention_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: int) -> int:
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ValueError(f"attention expects q [B, H, T, hd] and k, v [B, KV, T, hd]; "
                         f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads cannot share {k.shape[1]} key/value heads evenly")
    if chunk < 1:
        raise ValueError(f"attention chunk must be positive, got {chunk}")
    return q.shape[1] // k.shape[1]


def causal_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             chunk: int, window: int | None = None, scale: float | None = None) -> torch.Tensor:
    """Causal softmax attention, q [B, H, T, hd], k/v [B, KV, T, hd] (query head h reads KV head
    h // (H/KV), as SDPA's enable_gqa); scale 1/sqrt(hd) unless given; a sliding `window` limits each
    query to itself and the window - 1 keys before it. Returns [B, H, T, hd].

    Queries are processed `chunk` rows at a time against the keys they can see, so the largest
    temporary is [B, H, chunk, T] -- never the [B, H, T, T] score matrix.
    """
    groups = _check_attention_shapes(q, k, v, chunk)
    batch, heads, seq_len, head_dim = q.shape
    work = compute_dtype(q.dtype)
    keys, values = contiguous(k.to(work)), contiguous(v.to(work))
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    out, out_by_group = _sequence_major_empty(batch, heads, groups, seq_len, head_dim, q.dtype, q.device)
    for start in range(0, seq_len, chunk):
        stop = min(start + chunk, seq_len)
        probs = _causal_probabilities(_query_chunk(q, start, stop, groups).to(work), keys[:, :, :stop],
                                      start, stop, groups, scale, window)
        out_chunk = matmul(probs, values[:, :, :stop])
        del probs
        out_by_group[:, :, :, start:stop] = out_chunk.view(batch, heads // groups, groups, stop - start, head_dim)
    return out


def causal_attention_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                              grad_out: torch.Tensor, chunk: int, window: int | None = None,
                              scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dL/dq, dL/dk, dL/dv of causal_attention_forward, given its output `out` and dL/d(out).

    Per query chunk the probabilities P are recomputed (Appendix A.2) and
      dV += P^T dO,  dS = P * (dO V^T - rowsum(dO * O)),  dQ = dS K s,  dK += dS^T Q s
    (rowsum(dO * O) = rowsum(P * dP), the softmax backward's correction, without a [C, T] temporary).
    """
    groups = _check_attention_shapes(q, k, v, chunk)
    batch, heads, seq_len, head_dim = q.shape
    kv_heads = heads // groups
    work = compute_dtype(q.dtype)
    keys, values = contiguous(k.to(work)), contiguous(v.to(work))
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    grad_q, grad_q_by_group = _sequence_major_empty(batch, heads, groups, seq_len, head_dim, q.dtype, q.device)
    grad_k, grad_v = (_zeros(keys.shape, work, q.device) for _ in range(2))
    for start in range(0, seq_len, chunk):
        stop = min(start + chunk, seq_len)
        q_chunk = _query_chunk(q, start, stop, groups).to(work)
        grad_out_chunk = _query_chunk(grad_out, start, stop, groups).to(work)
        out_chunk = _query_chunk(out, start, stop, groups).to(work)
        products = step_buffers.empty(out_chunk.shape, work, q.device)
        products = grad_out_chunk * out_chunk if products is None else torch.mul(grad_out_chunk, out_chunk,
                                                                                  out=products)
        correction = products.sum(-1, keepdim=True)
        del products, out_chunk
        probs = _causal_probabilities(q_chunk, keys[:, :, :stop], start, stop, groups, scale, window)
        grad_v[:, :, :stop] += matmul(probs.transpose(-1, -2), grad_out_chunk)
        grad_scores = matmul(grad_out_chunk, values[:, :, :stop].transpose(-1, -2))
        grad_scores.sub_(correction).mul_(probs).mul_(scale)
        del probs
        grad_q_chunk = matmul(grad_scores, keys[:, :, :stop])
        grad_q_by_group[:, :, :, start:stop] = grad_q_chunk.view(batch, kv_heads, groups, stop - start, head_dim)
        grad_k[:, :, :stop] += matmul(grad_scores.transpose(-1, -2), q_chunk)
        del grad_scores
    return grad_q, grad_k.to(k.dtype), grad_v.to(v.dtype)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    out = step_buffers.empty(shape, dtype, device)
    return torch.zeros(shape, dtype=dtype, device=device) if out is None else out.zero_()


# -- SwiGLU ----------------------------------------------------------------------------------------

def swiglu_forward(gate: torch.Tensor, up: torch.Tensor, overwrite_inputs: bool = False) -> torch.Tensor:
    """silu(gate) * up. overwrite_inputs=True computes it in gate's buffer (gate is consumed)."""
    out = None if overwrite_inputs else step_buffers.empty(gate.shape, gate.dtype, gate.device)
    activation = F.silu(gate, inplace=overwrite_inputs) if out is None else torch._C._nn.silu(gate, out=out)
    return activation.mul_(up)


def swiglu_backward(gate: torch.Tensor, up: torch.Tensor, grad_out: torch.Tensor,
                    overwrite_inputs: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """dL/dgate, dL/dup of silu(gate) * up (Appendix A.4):
      d_up = g * silu(gate),  d_gate = g * up * silu'(gate),  silu' = sig + silu (1 - sig).

    overwrite_inputs=True consumes gate, up and grad_out (the caller must not read them afterwards):
    the results are written into up's and grad_out's buffers and only one [N, I] temporary (the
    sigmoid) is allocated, instead of four.
    """
    if not overwrite_inputs:
        gate, up, grad_out = gate.clone(), up.clone(), grad_out.clone()
    derivative = step_buffers.empty(gate.shape, gate.dtype, gate.device)
    derivative = torch.sigmoid(gate) if derivative is None else torch.sigmoid(gate, out=derivative)
    silu = gate.mul_(derivative)
    grad_gate = up.mul_(grad_out)
    grad_up = grad_out.mul_(silu)
    derivative.addcmul_(derivative, silu, value=-1).add_(silu)  # sig - sig*silu + silu
    return grad_gate.mul_(derivative), grad_up


def geglu_forward(gate: torch.Tensor, up: torch.Tensor, overwrite_inputs: bool = False) -> torch.Tensor:
    """gelu_tanh(gate) * up (Gemma's GeGLU), torch's own GELU kernel as the model's MLP uses it."""
    return F.gelu(gate, approximate="tanh").mul_(up)


def geglu_backward(gate: torch.Tensor, up: torch.Tensor, grad_out: torch.Tensor,
                   overwrite_inputs: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """dL/dgate, dL/dup of gelu_tanh(gate) * up: d_up = g * gelu(gate), d_gate = gelu'(gate) * g * up, the
    derivative by torch's own GELU backward kernel (what autograd computes)."""
    grad_up = F.gelu(gate, approximate="tanh").mul_(grad_out)
    grad_gate = torch.ops.aten.gelu_backward(grad_out * up, gate, approximate="tanh")
    return grad_gate, grad_up


# The gated MLP's activation by LlamaConfig.hidden_activation: (forward, backward), each taking gate and up
# [N, intermediate] (and dL/d(out)) with the overwrite_inputs contract of swiglu_forward / swiglu_backward.
GATED_ACTIVATIONS = {"silu": (swiglu_forward, swiglu_backward), "gelu_pytorch_tanh": (geglu_forward, geglu_backward)}


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    out = step_buffers.empty(shape, dtype, device)
    return torch.empty(shape, dtype=dtype, device=device) if out is None else out


# -- linear layers with optional LoRA ------------------------------------------------------------------

@dataclass
class LinearWeights:
    """A frozen linear y = x W^T + b, plus a LoRA adapter (A [r, in], B [out, r], scale) when present.
    The tensors are plain (detached) views of the module's parameters."""

    weight: torch.Tensor | None
    bias: torch.Tensor | None = None
    lora_A: torch.Tensor | None = None
    lora_B: torch.Tensor | None = None
    scale: float = 1.0
    # A quantised base (edgetrain.models.quantized.PackedMatrix): weight is None and the dense matrix is
    # made anew at each use, a tile of rows at a time in a reused scratch buffer (PackedMatrix.scratch_tiles).
    packed: Any = None

    def dense_weight(self) -> torch.Tensor:
        return self.weight if self.packed is None else self.packed.dequantize()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T + b for a 2-D x."""
        if self.packed is None:
            out = None if self.bias is not None else step_buffers.empty((x.shape[0], self.weight.shape[0]), x.dtype,
                                                                          x.device)
            # F.linear without a bias is this mm; with one (an addmm) it is left alone, to stay that sum.
            return F.linear(x, self.weight, self.bias) if out is None else torch.mm(x, self.weight.t(), out=out)
        tiled_product = getattr(self.packed, "tiled_product", None)
        if tiled_product is not None:  # a traced export's (edgetrain/export/mesp_graph.py)
            y = tiled_product(x)
            return y if self.bias is None else y + self.bias
        y = _empty((x.shape[0], self.packed.rows), x.dtype, x.device)
        for start, stop, tile in self.packed.scratch_tiles(x.dtype):
            torch.mm(x, tile.t(), out=y[:, start:stop])
        return y if self.bias is None else y.add_(self.bias)

    def add_input_grad(self, grad_x: torch.Tensor | None, grad: torch.Tensor) -> torch.Tensor:
        """grad_x + grad W (grad W when grad_x is None; added in place otherwise)."""
        if self.packed is None:
            return matmul(grad, self.weight) if grad_x is None else grad_x.addmm_(grad, self.weight)
        if grad_x is None:
            grad_x = _zeros((grad.shape[0], self.packed.cols), grad.dtype, grad.device)
        for start, stop, tile in self.packed.scratch_tiles(grad.dtype):
            grad_x.addmm_(grad[:, start:stop], tile)
        return grad_x

    @property
    def has_lora(self) -> bool:
        return self.lora_A is not None

    @property
    def rank(self) -> int:
        return 0 if self.lora_A is None else self.lora_A.shape[0]


@dataclass
class LoRAGradients:
    """Accumulators for one adapter's gradients; partial products are added in place."""

    lora_A: torch.Tensor
    lora_B: torch.Tensor

    @classmethod
    def zeros_like(cls, linear: LinearWeights, dtype: torch.dtype | None = None) -> "LoRAGradients":
        if linear.lora_A is None or linear.lora_B is None:
            raise ValueError("a plain linear has no LoRA gradients")
        dtype = dtype or linear.lora_A.dtype
        return cls(torch.zeros_like(linear.lora_A, dtype=dtype), torch.zeros_like(linear.lora_B, dtype=dtype))


def lora_projection(x: torch.Tensor, linears: Sequence[LinearWeights]) -> torch.Tensor | None:
    """x @ [A_1; A_2; ...]^T for the adapted linears among `linears` (which share the input x):
    one matmul for all of them. [N, sum of ranks], or None when none is adapted."""
    adapters = [lin.lora_A for lin in linears if lin.lora_A is not None]
    if not adapters:
        return None
    stacked = adapters[0] if len(adapters) == 1 else torch.cat(adapters, dim=0)
    return x @ stacked.t()


def linear_group_forward(x: torch.Tensor, linears: Sequence[LinearWeights]
                         ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """Outputs of linears that read the same 2-D input x [N, in], and the fused LoRA projection
    x @ [A...]^T that produced their low-rank terms (the caller keeps or drops it)."""
    projection = lora_projection(x, linears)
    outputs, offset = [], 0
    for lin in linears:
        y = lin.forward(x)
        if lin.lora_B is not None:
            y.addmm_(projection[:, offset:offset + lin.rank], lin.lora_B.t(), alpha=lin.scale)
            offset += lin.rank
        outputs.append(y)
    return outputs, projection


def lora_group_backward(x: torch.Tensor, linears: Sequence[LinearWeights], grad_outputs: Sequence[torch.Tensor],
                        lora_grads: Sequence[LoRAGradients | None],
                        projection: torch.Tensor | None = None) -> torch.Tensor | None:
    """The LoRA half of linear_group_backward (Appendix A.1): for each adapter, with u = x A^T and
    g = dL/dy,  dB += s g^T u  and  dA += s (g B)^T x, added into `lora_grads` (None entries for
    plain linears). u is recomputed from x -- one matmul for all adapters -- unless the caller
    stored it (`projection`, as linear_group_forward returned it).

    Returns s (g B) for all adapters side by side [N, sum of ranks] (None without adapters): all
    that linear_group_input_grad needs besides the weights, so the caller can free x before the
    [N, in] input gradient is allocated.
    """
    adapted = [i for i, lin in enumerate(linears) if lin.has_lora]
    if not adapted:
        return None
    if any(lora_grads[i] is None for i in adapted):
        raise ValueError("every linear with a LoRA adapter needs a gradient accumulator")
    if projection is None:
        projection = lora_projection(x, linears)
    grad_projection = torch.cat([grad_outputs[i] @ linears[i].lora_B * linears[i].scale for i in adapted], dim=1)
    grad_A_stacked = grad_projection.t() @ x
    offset = 0
    for i in adapted:
        lin, acc = linears[i], lora_grads[i]
        accumulate_matmul(acc.lora_B, grad_outputs[i].t(), projection[:, offset:offset + lin.rank], alpha=lin.scale)
        acc.lora_A.add_(grad_A_stacked[offset:offset + lin.rank])
        offset += lin.rank
    return grad_projection


def linear_group_input_grad(linears: Sequence[LinearWeights], grad_outputs: Sequence[torch.Tensor],
                            grad_projection: torch.Tensor | None) -> torch.Tensor:
    """dL/dx = sum g W + sum s (g B) A for linears sharing the input x, accumulated in one buffer."""
    grad_x = None
    for lin, grad in zip(linears, grad_outputs):
        grad_x = lin.add_input_grad(grad_x, grad)
    if grad_projection is not None:
        grad_x.addmm_(grad_projection, torch.cat([lin.lora_A for lin in linears if lin.has_lora], dim=0))
    return grad_x


def linear_group_backward(x: torch.Tensor, linears: Sequence[LinearWeights],
                          grad_outputs: Sequence[torch.Tensor],
                          lora_grads: Sequence[LoRAGradients | None],
                          projection: torch.Tensor | None = None,
                          need_grad_input: bool = True) -> torch.Tensor | None:
    """Backward of linear_group_forward: LoRA gradients added into `lora_grads` (see
    lora_group_backward) and dL/dx [N, in] returned (None when need_grad_input is False)."""
    grad_projection = lora_group_backward(x, linears, grad_outputs, lora_grads, projection)
    if not need_grad_input:
        return None
    return linear_group_input_grad(linears, grad_outputs, grad_projection)
