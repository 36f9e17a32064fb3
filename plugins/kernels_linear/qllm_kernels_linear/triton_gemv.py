"""Triton GEMV: ``out [M, N] = x [M, K] @ weight[N, K]^T (+ bias)`` for ``M <= MAX_GEMV_ROWS``.

One program per ``BLOCK_N`` weight rows, no split over K: it walks K in ``BLOCK_K`` steps,
each step one contiguous ``BLOCK_K`` segment of each of its rows (16-byte loads, read once, the
``evict_first`` hint since no other program reads them) and the same columns of every ``x``
row. Products accumulate elementwise in a ``[BLOCK_M, BLOCK_N, BLOCK_K]`` fp32 tile, reduced
over K once after the loop, so the loop has no cross-thread reduction. The tiles are indexed as
3-D pointers (``x`` as ``[BLOCK_M, 1, BLOCK_K]``, the weight as ``[1, BLOCK_N, BLOCK_K]``) so
the loads set the layout of the product (each thread holding all ``BLOCK_M`` rows of its
weight elements) instead of being converted into it (and with ``BLOCK_K = 256 * num_warps``,
see ``configs``, ``x``'s own load layout is the product's too). Bias is added in fp32 in the
epilogue; the output is rounded once to ``x.dtype``. The launch depends on shapes only (no
host sync).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qllm_kernels_linear.configs import MAX_GEMV_ROWS, GemvConfig, block_m, default_config


# N only bounds the rows, so a new N (divisible by 16 or not) needs no new compile.
@triton.jit(do_not_specialize=["N"])
def _gemv_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K,
                 stride_xm, stride_xk, stride_wn, stride_b, stride_om,
                 HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr):
    offs_m = tl.arange(0, BLOCK_M)                                   # [BM]
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)      # [BN]
    offs_k = tl.arange(0, BLOCK_K)                                   # [BK]
    x_ptrs = (x_ptr + offs_m[:, None, None] * stride_xm
              + offs_k[None, None, :] * stride_xk)                   # [BM, 1, BK]
    w_ptrs = (w_ptr + offs_n[None, :, None].to(tl.int64) * stride_wn
              + offs_k[None, None, :])                               # [1, BN, BK]
    x_rows = offs_m[:, None, None] < M
    w_rows = offs_n[None, :, None] < N
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        cols = offs_k[None, None, :] < K - k                         # [1, 1, BK]
        x = tl.load(x_ptrs, mask=x_rows & cols, other=0.0, eviction_policy="evict_last")
        w = tl.load(w_ptrs, mask=w_rows & cols, other=0.0, eviction_policy="evict_first")
        acc += x.to(tl.float32) * w.to(tl.float32)                   # [BM, BN, BK]
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K
    out = tl.sum(acc, axis=2)                                        # [BM, BN]
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n * stride_b, mask=offs_n < N, other=0.0)
        out += bias.to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty),
             mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: GemvConfig | None = None) -> torch.Tensor:
    """``x [M, K]`` (any strides) @ ``weight [N, K]^T`` (rows contiguous: ``stride(1) == 1``)
    plus ``bias [N]`` -> ``out [M, N]`` in ``x.dtype``, for ``1 <= M <= MAX_GEMV_ROWS``;
    ``config`` overrides ``configs.default_config``. Inputs share one float dtype."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"gemv: x [M, K] and weight [N, K] expected, got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    (m, k), n = x.shape, weight.shape[0]
    if not 1 <= m <= MAX_GEMV_ROWS:
        raise ValueError(f"gemv serves 1 to {MAX_GEMV_ROWS} rows, got {m}")
    if weight.stride(1) != 1:
        raise ValueError(f"gemv needs contiguous weight rows, got strides {weight.stride()}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"gemv: bias of shape {tuple(bias.shape)} for {n} output features")
    config = config or default_config(m, n, k)
    out = x.new_empty(m, n)
    _gemv_kernel[(triton.cdiv(n, config.BLOCK_N),)](
        x, weight, bias, out, m, n, k,
        x.stride(0), x.stride(1), weight.stride(0), 0 if bias is None else bias.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=block_m(m), BLOCK_N=config.BLOCK_N,
        BLOCK_K=config.BLOCK_K, NUM_STAGES=config.num_stages, num_warps=config.num_warps,
        num_stages=config.num_stages)
    return out
