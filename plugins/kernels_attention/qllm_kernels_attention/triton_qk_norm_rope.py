"""The attention layers' q/k path in one Triton kernel (contract and reference:
``qllm.ops.rope.qk_norm_rope``): each head of q and k RMS-normalised with its weight, then its
first ``R`` dims rotated as pairs ``(i, i + R / 2)`` (NeoX), the rest passed through.

Left to ``torch.compile``, Qwen3.5's decode graph ran this path (with the K/V store) as 9-10
small kernels per attention layer, the norms split into a reduction and a pointwise kernel
each (about 14 us per layer at W2's batch 200, 12 us at batch 1). Here one program per token
reads its q and k heads once and writes them normalised and rotated.

Casts follow ``qllm.ops.norm.rms_norm``: ``x_hat`` in fp32; a zero-centred weight multiplies
in fp32, a plain one multiplies ``x_hat`` rounded to the input dtype. The rotation reads cos
and sin rounded to the input dtype and computes in fp32, rounding once at the store (as
Inductor compiles the reference; eager torch rounds each product).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

NUM_WARPS = 4


@triton.jit
def _scaled(x, inv_rms, weight_ptr, dims, mask_d, ZERO_CENTERED: tl.constexpr):
    """``x [H, n]`` (fp32) times ``inv_rms [H]`` and its weights ``weight[dims]``, rounded to
    the weight's dtype (the activations' dtype) the way ``rms_norm`` rounds."""
    weight = tl.load(weight_ptr + dims, mask=mask_d, other=0.0)  # [n]
    x_hat = x * inv_rms[:, None]
    if ZERO_CENTERED:
        return (x_hat * (1.0 + weight.to(tl.float32))[None, :]).to(weight.dtype)
    return (weight.to(tl.float32)[None, :]
            * x_hat.to(weight.dtype).to(tl.float32)).to(weight.dtype)


@triton.jit
def _norm_rotate_heads(src_ptr, dst_ptr, weight_ptr, token, stride_tok, stride_head, cos, sin,
                       eps, NUM_HEADS: tl.constexpr, H_PAD: tl.constexpr, D: tl.constexpr,
                       HALF: tl.constexpr, HALF_PAD: tl.constexpr, REST: tl.constexpr,
                       REST_PAD: tl.constexpr, ZERO_CENTERED: tl.constexpr):
    """Normalise and rotate the ``NUM_HEADS`` heads of one token: ``src`` strided, ``dst``
    contiguous ``[T, NUM_HEADS, D]``; ``cos``, ``sin [HALF_PAD]`` in fp32."""
    heads = tl.arange(0, H_PAD)  # [H]
    half = tl.arange(0, HALF_PAD)  # [n]
    mask_h = heads < NUM_HEADS
    mask_half = half < HALF
    mask = mask_h[:, None] & mask_half[None, :]  # [H, n]
    src = src_ptr + token * stride_tok + heads[:, None] * stride_head  # [H, 1]
    dst = dst_ptr + (token * NUM_HEADS + heads[:, None]) * D  # [H, 1]

    x1 = tl.load(src + half[None, :], mask=mask, other=0.0).to(tl.float32)  # [H, n]
    x2 = tl.load(src + HALF + half[None, :], mask=mask, other=0.0).to(tl.float32)
    sum_sq = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)  # [H]
    if REST > 0:
        rest = tl.arange(0, REST_PAD)  # [r]
        mask_rest = mask_h[:, None] & (rest < REST)[None, :]  # [H, r]
        xr = tl.load(src + 2 * HALF + rest[None, :], mask=mask_rest, other=0.0).to(tl.float32)
        sum_sq += tl.sum(xr * xr, axis=1)
    inv_rms = tl.rsqrt(sum_sq / D + eps)  # [H]

    n1 = _scaled(x1, inv_rms, weight_ptr, half, mask_half, ZERO_CENTERED).to(tl.float32)
    n2 = _scaled(x2, inv_rms, weight_ptr, HALF + half, mask_half,
                 ZERO_CENTERED).to(tl.float32)
    out_ty = dst_ptr.dtype.element_ty
    tl.store(dst + half[None, :], (n1 * cos[None, :] - n2 * sin[None, :]).to(out_ty),
             mask=mask)
    tl.store(dst + HALF + half[None, :], (n2 * cos[None, :] + n1 * sin[None, :]).to(out_ty),
             mask=mask)
    if REST > 0:
        nr = _scaled(xr, inv_rms, weight_ptr, 2 * HALF + rest, rest < REST, ZERO_CENTERED)
        tl.store(dst + 2 * HALF + rest[None, :], nr.to(out_ty), mask=mask_rest)


@triton.jit
def _qk_norm_rope_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, q_weight_ptr, k_weight_ptr,
                         cos_sin_ptr, positions_ptr, eps,
                         stride_q_tok, stride_q_head, stride_k_tok, stride_k_head,
                         stride_cos_sin,
                         HQ: tl.constexpr, HQ_PAD: tl.constexpr, HK: tl.constexpr,
                         HK_PAD: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
                         HALF_PAD: tl.constexpr, REST: tl.constexpr, REST_PAD: tl.constexpr,
                         ZERO_CENTERED: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token)
    half = tl.arange(0, HALF_PAD)
    table = cos_sin_ptr + position * stride_cos_sin + half  # [n]: the position's [cos | sin]
    act_ty = q_out_ptr.dtype.element_ty
    cos = tl.load(table, mask=half < HALF, other=0.0).to(act_ty).to(tl.float32)  # [n]
    sin = tl.load(table + HALF, mask=half < HALF, other=0.0).to(act_ty).to(tl.float32)
    _norm_rotate_heads(q_ptr, q_out_ptr, q_weight_ptr, token, stride_q_tok, stride_q_head,
                       cos, sin, eps, HQ, HQ_PAD, D, HALF, HALF_PAD, REST, REST_PAD,
                       ZERO_CENTERED)
    _norm_rotate_heads(k_ptr, k_out_ptr, k_weight_ptr, token, stride_k_tok, stride_k_head,
                       cos, sin, eps, HK, HK_PAD, D, HALF, HALF_PAD, REST, REST_PAD,
                       ZERO_CENTERED)


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
    _qk_norm_rope_kernel[(tokens,)](
        q, k, q_out, k_out, q_weight, k_weight, cos_sin, positions, eps,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin.stride(0),
        HQ=num_q_heads, HQ_PAD=triton.next_power_of_2(num_q_heads),
        HK=num_k_heads, HK_PAD=triton.next_power_of_2(num_k_heads), D=dim,
        HALF=half, HALF_PAD=triton.next_power_of_2(half), REST=rest,
        REST_PAD=triton.next_power_of_2(max(rest, 1)), ZERO_CENTERED=zero_centered,
        num_warps=NUM_WARPS)
    return q_out, k_out
