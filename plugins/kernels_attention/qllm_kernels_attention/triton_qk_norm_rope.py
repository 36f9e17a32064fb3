"""The attention layers' q/k path in one Triton kernel (contract and reference:
``qllm.ops.rope.qk_norm_rope``): each head of q and k RMS-normalised with its weight, then its
first ``R`` dims rotated as pairs ``(i, i + R / 2)`` (NeoX), the rest passed through.

Left to ``torch.compile``, Qwen3.5's decode graph ran this path (with the K/V store) as 9-10
small kernels per attention layer, the norms split into a reduction and a pointwise kernel
each (about 14 us per layer at W2's batch 200, 11 us at batch 1). Here one program per (token,
head) reads its head once and writes it normalised and rotated. (One program per token walking
all 18 heads took 4.7 us at batch 1 and 4.6 us at batch 200: latency-bound.)

Casts follow ``qllm.ops.norm.rms_norm``: ``x_hat`` in fp32; a zero-centred weight multiplies
in fp32, a plain one multiplies ``x_hat`` rounded to the input dtype. The rotation reads cos
and sin rounded to the input dtype and computes in fp32, rounding once at the store (as
Inductor compiles the reference; eager torch rounds each product).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

NUM_WARPS = 1  # a program holds one head: D values


@triton.jit
def _scaled(x, inv_rms, weight_ptr, dims, mask, ZERO_CENTERED: tl.constexpr):
    """``x [n]`` (fp32) times ``inv_rms`` and its weights ``weight[dims]``, rounded to the
    weight's dtype (the activations' dtype) the way ``rms_norm`` rounds."""
    weight = tl.load(weight_ptr + dims, mask=mask, other=0.0)  # [n]
    x_hat = x * inv_rms
    if ZERO_CENTERED:
        return (x_hat * (1.0 + weight.to(tl.float32))).to(weight.dtype)
    return (weight.to(tl.float32) * x_hat.to(weight.dtype).to(tl.float32)).to(weight.dtype)


@triton.jit
def _qk_norm_rope_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, q_weight_ptr, k_weight_ptr,
                         cos_sin_ptr, positions_ptr, eps,
                         stride_q_tok, stride_q_head, stride_k_tok, stride_k_head,
                         stride_cos_sin,
                         HQ: tl.constexpr, HK: tl.constexpr, D: tl.constexpr,
                         HALF: tl.constexpr, HALF_PAD: tl.constexpr, REST: tl.constexpr,
                         REST_PAD: tl.constexpr, ZERO_CENTERED: tl.constexpr):
    """One head of one token: program ``(t, h)`` takes q head ``h`` for ``h < HQ``, else k head
    ``h - HQ``."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    is_q = head < HQ
    if is_q:
        src = q_ptr + token * stride_q_tok + head * stride_q_head
        dst = q_out_ptr + (token * HQ + head) * D
        weight_ptr = q_weight_ptr
    else:
        src = k_ptr + token * stride_k_tok + (head - HQ) * stride_k_head
        dst = k_out_ptr + (token * HK + head - HQ) * D
        weight_ptr = k_weight_ptr

    half = tl.arange(0, HALF_PAD)  # [n]
    mask_half = half < HALF
    x1 = tl.load(src + half, mask=mask_half, other=0.0).to(tl.float32)  # [n]
    x2 = tl.load(src + HALF + half, mask=mask_half, other=0.0).to(tl.float32)
    sum_sq = tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)
    if REST > 0:
        rest = tl.arange(0, REST_PAD)  # [r]
        mask_rest = rest < REST
        xr = tl.load(src + 2 * HALF + rest, mask=mask_rest, other=0.0).to(tl.float32)
        sum_sq += tl.sum(xr * xr, axis=0)
    inv_rms = tl.rsqrt(sum_sq / D + eps)

    position = tl.load(positions_ptr + token)
    table = cos_sin_ptr + position * stride_cos_sin + half  # [n]: the position's [cos | sin]
    out_ty = q_out_ptr.dtype.element_ty
    cos = tl.load(table, mask=mask_half, other=0.0).to(out_ty).to(tl.float32)  # [n]
    sin = tl.load(table + HALF, mask=mask_half, other=0.0).to(out_ty).to(tl.float32)
    n1 = _scaled(x1, inv_rms, weight_ptr, half, mask_half, ZERO_CENTERED).to(tl.float32)
    n2 = _scaled(x2, inv_rms, weight_ptr, HALF + half, mask_half, ZERO_CENTERED).to(tl.float32)
    tl.store(dst + half, (n1 * cos - n2 * sin).to(out_ty), mask=mask_half)
    tl.store(dst + HALF + half, (n2 * cos + n1 * sin).to(out_ty), mask=mask_half)
    if REST > 0:
        nr = _scaled(xr, inv_rms, weight_ptr, 2 * HALF + rest, mask_rest, ZERO_CENTERED)
        tl.store(dst + 2 * HALF + rest, nr.to(out_ty), mask=mask_rest)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                 k_weight: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor,
                 eps: float, zero_centered: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [T, Hq, D]``, ``k [T, Hk, D]`` (unit last stride), weights ``[D]`` in their dtype,
    ``cos_sin [P, R]`` (unit last stride), ``positions [T]`` -> contiguous ``(q, k)``."""
    tokens, num_q_heads, dim = q.shape
    num_k_heads = k.shape[1]
    half = cos_sin.shape[-1] // 2
    rest = dim - 2 * half
    q_out = torch.empty(tokens, num_q_heads, dim, dtype=q.dtype, device=q.device)
    k_out = torch.empty(tokens, num_k_heads, dim, dtype=k.dtype, device=k.device)
    if tokens == 0:
        return q_out, k_out
    _qk_norm_rope_kernel[(tokens, num_q_heads + num_k_heads)](
        q, k, q_out, k_out, q_weight, k_weight, cos_sin, positions, eps,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin.stride(0),
        HQ=num_q_heads, HK=num_k_heads, D=dim,
        HALF=half, HALF_PAD=triton.next_power_of_2(half), REST=rest,
        REST_PAD=triton.next_power_of_2(max(rest, 1)), ZERO_CENTERED=zero_centered,
        num_warps=NUM_WARPS)
    return q_out, k_out
