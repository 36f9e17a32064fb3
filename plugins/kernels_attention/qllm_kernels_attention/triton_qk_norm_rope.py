"""The attention layers' q/k path in one Triton kernel (contract and reference:
``qllm.ops.rope.qk_norm_rope``): each head of q and k RMS-normalised with its weight, then its
first ``R`` dims rotated as pairs ``(i, i + R / 2)`` (NeoX), the rest passed through.

Left to ``torch.compile``, Qwen3.5's decode graph ran this path (with the K/V store) as 9-10
small kernels per attention layer, the norms split into a reduction and a pointwise kernel
each (about 14 us per layer at W2's batch 200, 11 us at batch 1). Here a program reads a block
of one token's heads once and writes them normalised and rotated: one head per program for
decode batches, all of a token's heads for prefill (``PER_HEAD_MAX_TOKENS``).

Casts follow ``qllm.ops.norm.rms_norm``: ``x_hat`` in fp32; a zero-centred weight multiplies
in fp32, a plain one multiplies ``x_hat`` rounded to the input dtype. The rotation reads cos
and sin rounded to the input dtype and computes in fp32, rounding once at the store (as
Inductor compiles the reference; eager torch rounds each product).

In small decode steps (``qllm.plugins.pdl``, at most ``PDL_MAX_ROWS`` rows) it is launched with
programmatic dependent launch: it reads its token's position, that position's rotation and the
norms' weights, then waits for the previous kernel (``qllm.plugins.pdl.pdl_wait``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qllm.plugins.pdl import pdl_arguments, pdl_release, pdl_wait

# Up to this many tokens (decode batches) a program takes one head: one program per token walked
# Qwen3.5's 18 heads latency-bound (4.7 us at 1 token, 4.6 at 200). Prefill steps keep a
# program per token, not hundreds of thousands of one-warp programs.
PER_HEAD_MAX_TOKENS = 256


@triton.jit
def _scaled(x, inv_rms, weights, ZERO_CENTERED: tl.constexpr):
    """``x [H, n]`` (fp32) times ``inv_rms [H]`` and ``weights [H, n]``, rounded to the
    weights' dtype (the activations' dtype) the way ``rms_norm`` rounds."""
    x_hat = x * inv_rms[:, None]
    if ZERO_CENTERED:
        return (x_hat * (1.0 + weights.to(tl.float32))).to(weights.dtype)
    return (weights.to(tl.float32) * x_hat.to(weights.dtype).to(tl.float32)).to(weights.dtype)


@triton.jit
def _qk_norm_rope_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, q_weight_ptr, k_weight_ptr,
                         cos_sin_ptr, positions_ptr, eps,
                         stride_q_tok, stride_q_head, stride_k_tok, stride_k_head,
                         stride_cos_sin,
                         HQ: tl.constexpr, HK: tl.constexpr, D: tl.constexpr,
                         HALF: tl.constexpr, HALF_PAD: tl.constexpr, REST: tl.constexpr,
                         REST_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
                         ZERO_CENTERED: tl.constexpr, USE_PDL: tl.constexpr):
    """Program ``(t, g)``: heads ``[g * BLOCK_H, (g + 1) * BLOCK_H)`` of token ``t``, counting
    the ``HQ`` q heads first, then the ``HK`` k heads."""
    pdl_release(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [H]
    is_q = heads < HQ
    k_heads = heads - HQ
    src = tl.where(is_q, q_ptr + token * stride_q_tok + heads * stride_q_head,
                   k_ptr + token * stride_k_tok + k_heads * stride_k_head)[:, None]  # [H, 1]
    dst = tl.where(is_q, q_out_ptr + (token * HQ + heads) * D,
                   k_out_ptr + (token * HK + k_heads) * D)[:, None]  # [H, 1]
    weight = tl.where(is_q, q_weight_ptr, k_weight_ptr)[:, None]  # [H, 1]
    mask_h = (heads < HQ + HK)[:, None]

    half = tl.arange(0, HALF_PAD)[None, :]  # [1, n]
    mask = mask_h & (half < HALF)  # [H, n]
    # before the PDL wait: the step's position and its rotation, the norms' weights
    position = tl.load(positions_ptr + token)
    table = cos_sin_ptr + position * stride_cos_sin + half  # [1, n]: the position's [cos | sin]
    out_ty = q_out_ptr.dtype.element_ty
    cos = tl.load(table, mask=half < HALF, other=0.0).to(out_ty).to(tl.float32)  # [1, n]
    sin = tl.load(table + HALF, mask=half < HALF, other=0.0).to(out_ty).to(tl.float32)
    weight1 = tl.load(weight + half, mask=mask, other=0.0)  # [H, n]
    weight2 = tl.load(weight + HALF + half, mask=mask, other=0.0)
    pdl_wait(USE_PDL)  # q and k are the qkv_proj's output
    x1 = tl.load(src + half, mask=mask, other=0.0).to(tl.float32)  # [H, n]
    x2 = tl.load(src + HALF + half, mask=mask, other=0.0).to(tl.float32)
    sum_sq = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)  # [H]
    if REST > 0:
        rest = tl.arange(0, REST_PAD)[None, :]  # [1, r]
        mask_rest = mask_h & (rest < REST)  # [H, r]
        xr = tl.load(src + 2 * HALF + rest, mask=mask_rest, other=0.0).to(tl.float32)
        sum_sq += tl.sum(xr * xr, axis=1)
    inv_rms = tl.rsqrt(sum_sq / D + eps)  # [H]

    n1 = _scaled(x1, inv_rms, weight1, ZERO_CENTERED).to(tl.float32)
    n2 = _scaled(x2, inv_rms, weight2, ZERO_CENTERED).to(tl.float32)
    tl.store(dst + half, (n1 * cos - n2 * sin).to(out_ty), mask=mask)
    tl.store(dst + HALF + half, (n2 * cos + n1 * sin).to(out_ty), mask=mask)
    if REST > 0:
        nr = _scaled(xr, inv_rms, tl.load(weight + 2 * HALF + rest, mask=mask_rest, other=0.0),
                     ZERO_CENTERED)
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
    heads = num_q_heads + num_k_heads
    # decode: a program per head; prefill: a program per token, every head at once
    block_h = 1 if tokens <= PER_HEAD_MAX_TOKENS else triton.next_power_of_2(heads)
    _qk_norm_rope_kernel[(tokens, triton.cdiv(heads, block_h))](
        q, k, q_out, k_out, q_weight, k_weight, cos_sin, positions, eps,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin.stride(0),
        HQ=num_q_heads, HK=num_k_heads, D=dim,
        HALF=half, HALF_PAD=triton.next_power_of_2(half), REST=rest,
        REST_PAD=triton.next_power_of_2(max(rest, 1)), BLOCK_H=block_h,
        ZERO_CENTERED=zero_centered, num_warps=1 if block_h == 1 else 4,
        **pdl_arguments(q.device, tokens))
    return q_out, k_out
