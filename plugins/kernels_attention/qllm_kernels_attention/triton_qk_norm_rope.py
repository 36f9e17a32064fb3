"""The attention layers' q/k path in one Triton kernel (contract and reference:
``qllm.ops.rope.qk_norm_rope``): each head of q and k RMS-normalised with its weight, then its
first ``R`` dims rotated as pairs ``(i, i + R / 2)`` (NeoX), the rest passed through.

Left to ``torch.compile``, Qwen3.5's decode graph ran this path (with the K/V store) as 9-10
small kernels per attention layer, the norms split into a reduction and a pointwise kernel
each (about 14 us per layer at W2's batch 200, 11 us at batch 1). Here a program reads a block
of one token's heads once and writes them normalised and rotated: one head per program for
decode batches, all of a token's heads for prefill (``PER_HEAD_MAX_TOKENS``).

``qk_norm_rope_kv_store`` (contract: ``qllm.ops.attention.qk_norm_rope_kv_store``) is the same
kernel writing the keys into the paged cache instead of a ``k`` output, each k head's program
copying that head's values too: the K/V store's kernel (``triton_kv_store``) no longer runs
between the RoPE and the attention.

Casts follow ``qllm.ops.norm.rms_norm``: ``x_hat`` in fp32; a zero-centred weight multiplies
in fp32, a plain one multiplies ``x_hat`` rounded to the input dtype. The rotation reads cos
and sin rounded to the input dtype and computes in fp32, rounding once at the store (as
Inductor compiles the reference; eager torch rounds each product).

In small decode steps (``qllm.plugins.pdl``, at most ``PDL_MAX_ROWS`` rows) it is launched with
programmatic dependent launch: it reads its token's position, that position's rotation, the
norms' weights and the token's cache slot, then waits for the previous kernel
(``qllm.plugins.pdl.pdl_wait``).
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
def _store_rows(q_dst, k_dst, is_q, offsets, values, mask):
    """``values [H, n]`` rounded to q's dtype, into the q rows at ``q_dst`` or the k rows at
    ``k_dst`` (``[H, 1]`` pointers; k's in their own dtype: the output's or the cache's), at
    ``offsets [1, n]``."""
    values = values.to(q_dst.dtype.element_ty)
    tl.store(q_dst + offsets, values, mask=mask & is_q)
    tl.store(k_dst + offsets, values.to(k_dst.dtype.element_ty), mask=mask & ~is_q)


@triton.jit
def _qk_norm_rope_kernel(q_ptr, k_ptr, v_ptr, q_out_ptr, k_out_ptr, v_cache_ptr, q_weight_ptr,
                         k_weight_ptr, cos_sin_ptr, positions_ptr, slot_mapping_ptr, eps,
                         page_size,
                         stride_q_tok, stride_q_head, stride_k_tok, stride_k_head,
                         stride_v_tok, stride_v_head, stride_cos_sin,
                         stride_kc_page, stride_kc_row, stride_kc_head,
                         stride_vc_page, stride_vc_row, stride_vc_head,
                         HQ: tl.constexpr, HK: tl.constexpr, D: tl.constexpr,
                         D_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
                         REST: tl.constexpr, REST_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
                         ZERO_CENTERED: tl.constexpr, STORE: tl.constexpr,
                         USE_PDL: tl.constexpr):
    """Program ``(t, g)``: heads ``[g * BLOCK_H, (g + 1) * BLOCK_H)`` of token ``t``, counting
    the ``HQ`` q heads first, then the ``HK`` k heads. With ``STORE``, ``k_out`` is the key
    cache, written at the token's slot, and a k head's program also copies that head's value
    row into the value cache."""
    pdl_release(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [H]
    is_q = (heads < HQ)[:, None]  # [H, 1]
    k_heads = (heads - HQ)[:, None]  # [H, 1]
    src = tl.where(is_q, q_ptr + token * stride_q_tok + heads[:, None] * stride_q_head,
                   k_ptr + token * stride_k_tok + k_heads * stride_k_head)  # [H, 1]
    q_dst = q_out_ptr + (token * HQ + heads[:, None]) * D  # [H, 1]
    weight = tl.where(is_q, q_weight_ptr, k_weight_ptr)  # [H, 1]
    mask_h = (heads < HQ + HK)[:, None]

    half = tl.arange(0, HALF_PAD)[None, :]  # [1, n]
    mask = mask_h & (half < HALF)  # [H, n]
    # before the PDL wait: the step's position and its rotation, the norms' weights, the slot
    position = tl.load(positions_ptr + token)
    table = cos_sin_ptr + position * stride_cos_sin + half  # [1, n]: the position's [cos | sin]
    out_ty = q_out_ptr.dtype.element_ty
    cos = tl.load(table, mask=half < HALF, other=0.0).to(out_ty).to(tl.float32)  # [1, n]
    sin = tl.load(table + HALF, mask=half < HALF, other=0.0).to(out_ty).to(tl.float32)
    weight1 = tl.load(weight + half, mask=mask, other=0.0)  # [H, n]
    weight2 = tl.load(weight + HALF + half, mask=mask, other=0.0)
    if STORE:
        slot = tl.load(slot_mapping_ptr + token)
    pdl_wait(USE_PDL)  # q, k and v are the qkv_proj's output
    if STORE:  # the cache entry (its division branches in the SASS: after the wait)
        page, row = slot // page_size, slot % page_size
        k_dst = k_out_ptr + page * stride_kc_page + row * stride_kc_row + k_heads * stride_kc_head
    else:
        k_dst = k_out_ptr + (token * HK + k_heads) * D  # [H, 1]
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
    _store_rows(q_dst, k_dst, is_q, half, n1 * cos - n2 * sin, mask)
    _store_rows(q_dst, k_dst, is_q, HALF + half, n2 * cos + n1 * sin, mask)
    if REST > 0:
        nr = _scaled(xr, inv_rms, tl.load(weight + 2 * HALF + rest, mask=mask_rest, other=0.0),
                     ZERO_CENTERED)
        _store_rows(q_dst, k_dst, is_q, 2 * HALF + rest, nr, mask_rest)
    if STORE:  # the value rows of this program's k heads, as they are
        dims = tl.arange(0, D_PAD)[None, :]  # [1, D]
        mask_v = mask_h & ~is_q & (dims < D)  # [H, D]
        value = tl.load(v_ptr + token * stride_v_tok + k_heads * stride_v_head + dims,
                        mask=mask_v)
        tl.store(v_cache_ptr + page * stride_vc_page + row * stride_vc_row
                 + k_heads * stride_vc_head + dims,
                 value.to(v_cache_ptr.dtype.element_ty), mask=mask_v)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                 k_weight: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor,
                 eps: float, zero_centered: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [T, Hq, D]``, ``k [T, Hk, D]`` (unit last stride), weights ``[D]`` in their dtype,
    ``cos_sin [P, R]`` (unit last stride), ``positions [T]`` -> contiguous ``(q, k)``."""
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    return _launch(q, k, q_weight, k_weight, cos_sin, positions, eps, zero_centered,
                   k_out), k_out


def qk_norm_rope_kv_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          q_weight: torch.Tensor, k_weight: torch.Tensor,
                          cos_sin: torch.Tensor, positions: torch.Tensor, eps: float,
                          zero_centered: bool, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          slot_mapping: torch.Tensor) -> torch.Tensor:
    """``qk_norm_rope``, the keys written normalised and rotated into ``k_cache`` and ``v [T,
    Hk, D]`` as it is into ``v_cache`` (``[pages, page_size, Hk, D]``, unit last strides) at
    the flat entries ``slot_mapping [T]``, in place -> contiguous ``q``."""
    for name, x in (("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        if x.stride(-1) != 1:
            raise ValueError(f"qk_norm_rope_kv_store: {name}'s last dimension has stride "
                             f"{x.stride(-1)}, not 1")
    return _launch(q, k, q_weight, k_weight, cos_sin, positions, eps, zero_centered, k_cache,
                   (v, v_cache, slot_mapping))


def _launch(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
            cos_sin: torch.Tensor, positions: torch.Tensor, eps: float, zero_centered: bool,
            k_out: torch.Tensor,
            store: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
            ) -> torch.Tensor:
    """The kernel's launch -> ``q``'s output; k's go to ``k_out``, a ``[T, Hk, D]`` output, or
    with ``store = (v, v_cache, slot_mapping)`` the key cache."""
    tokens, num_q_heads, dim = q.shape
    num_k_heads = k.shape[1]
    half = cos_sin.shape[-1] // 2
    rest = dim - 2 * half
    q_out = torch.empty(tokens, num_q_heads, dim, dtype=q.dtype, device=q.device)
    if tokens == 0:
        return q_out
    v, v_cache, slot_mapping = store or (None, None, None)
    cache_strides = (k_out.stride()[:3] + v_cache.stride()[:3] if store else (0,) * 6)
    heads = num_q_heads + num_k_heads
    # decode: a program per head; prefill: a program per token, every head at once
    block_h = 1 if tokens <= PER_HEAD_MAX_TOKENS else triton.next_power_of_2(heads)
    _qk_norm_rope_kernel[(tokens, triton.cdiv(heads, block_h))](
        q, k, v, q_out, k_out, v_cache, q_weight, k_weight, cos_sin, positions, slot_mapping,
        eps, k_out.shape[1] if store else 1,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        *(v.stride()[:2] if store else (0, 0)), cos_sin.stride(0), *cache_strides,
        HQ=num_q_heads, HK=num_k_heads, D=dim, D_PAD=triton.next_power_of_2(dim),
        HALF=half, HALF_PAD=triton.next_power_of_2(half), REST=rest,
        REST_PAD=triton.next_power_of_2(max(rest, 1)), BLOCK_H=block_h,
        ZERO_CENTERED=zero_centered, STORE=store is not None,
        num_warps=1 if block_h == 1 else 4, **pdl_arguments(q.device, tokens))
    return q_out
