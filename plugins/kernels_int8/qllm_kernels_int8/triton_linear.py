"""Triton kernels of the 8-bit dense projections: ``out [M, N] = x [M, K] @ w[N, K]^T (+ bias)``.

- ``gemv_8bit`` (``M <= GEMV_MAX_ROWS``, decode at batch 1 to 4): kernels_linear's GEMV layout
  (one program per ``BLOCK_N`` weight rows, an elementwise ``[BLOCK_M, BLOCK_N, BLOCK_K]``
  fp32 accumulator reduced once after the loop) on 8-bit weights, dequantized in the loop:
  int8 rows times their scale in the epilogue (a per-row scale factors out of the sum); fp8
  blocks times ``scale_inv[n // bn, k // bk]`` per element (weight-only: ``x`` is not
  quantized). The kernel reads 1 byte per weight instead of 2.
- ``w8a16_gemm`` (int8, more rows): tiles of ``x`` times int8 weight tiles converted to
  ``x.dtype`` (exact: |q| <= 127) on the tensor cores, the per-row scale in the epilogue.
- ``fp8_group_quant`` + ``fp8_block_gemm`` (fp8, more rows): ``x`` quantized to e4m3 per
  token and group of ``bk`` columns, then an fp8 x fp8 tensor-core GEMM whose ``BLOCK_K``
  steps each lie in one group: ``acc += dot(a, w) * a_scale[m] * w_scale[n // bn]``.

Launch parameters are a rule, not yet measured (``gemv_config`` / ``gemm_config``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qllm_kernels_int8.quant import FP8_DTYPE, FP8_MAX, MIN_SCALE

GEMV_MAX_ROWS = 4
FP8_MAX_C = tl.constexpr(FP8_MAX)
MIN_SCALE_C = tl.constexpr(MIN_SCALE)


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def gemv_config(m: int, n: int, k: int) -> tuple[int, int, int]:
    """``(BLOCK_N, BLOCK_K, num_warps)``: 16 one-byte weights per thread and load, 4 warps
    along K, at least ~128 programs, a bounded accumulator."""
    warps = 4
    block_k = max(16, min(_pow2(k), 32 * 16 * warps))  # 2,048 columns per step
    block_n = 8
    while block_n > 1 and (-(-n // block_n) < 128
                           or _pow2(m) * block_n * block_k // (32 * warps) > 64):
        block_n //= 2
    return block_n, block_k, warps


@triton.jit(do_not_specialize=["N"])
def _gemv_8bit_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, M, N, K,
                      stride_xm, stride_wn, stride_sn, stride_om, scale_block_n,
                      BLOCK_SCALES: tl.constexpr, SCALE_BLOCK_K: tl.constexpr,
                      HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr):
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m[:, None, None] * stride_xm + offs_k[None, None, :]  # [BM, 1, BK]
    w_ptrs = (w_ptr + offs_n[None, :, None].to(tl.int64) * stride_wn
              + offs_k[None, None, :])  # [1, BN, BK]
    x_rows = offs_m[:, None, None] < M
    w_rows = offs_n[None, :, None] < N
    if BLOCK_SCALES:
        s_ptrs = scale_ptr + (offs_n // scale_block_n)[None, :, None] * stride_sn  # [1, BN, 1]
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        cols = offs_k[None, None, :] < K - k
        x = tl.load(x_ptrs, mask=x_rows & cols, other=0.0).to(tl.float32)
        w = tl.load(w_ptrs, mask=w_rows & cols, other=0.0).to(tl.float32)
        if BLOCK_SCALES:  # fp8: each element's block scale
            kb = (k + offs_k[None, None, :]) // SCALE_BLOCK_K
            w = w * tl.load(s_ptrs + kb, mask=w_rows & cols, other=0.0)
        acc += x * w
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    out = tl.sum(acc, axis=2)  # [BM, BN]
    if not BLOCK_SCALES:  # int8: the row's scale
        out *= tl.load(scale_ptr + offs_n, mask=offs_n < N, other=0.0)[None, :]
    if HAS_BIAS:
        out += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty),
             mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def gemv_8bit(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
              bias: torch.Tensor | None, block: tuple[int, int] | None = None,
              config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """``x [M, K]`` (rows contiguous) @ dequantized ``weight [N, K]``^T + ``bias`` -> ``[M,
    N]`` in ``x.dtype``, ``M <= GEMV_MAX_ROWS``. ``block`` ``None``: int8 with ``scale [N]``;
    else fp8 with ``scale [ceil(N/bn), ceil(K/bk)]`` (contiguous)."""
    (m, k), n = x.shape, weight.shape[0]
    block_n, block_k, warps = config or gemv_config(m, n, k)
    out = x.new_empty(m, n)
    _gemv_8bit_kernel[(triton.cdiv(n, block_n),)](
        x, weight, scale, bias, out, m, n, k, x.stride(0), weight.stride(0),
        scale.stride(0) if block else 1, out.stride(0), block[0] if block else 1,
        BLOCK_SCALES=block is not None, SCALE_BLOCK_K=block[1] if block else 1,
        HAS_BIAS=bias is not None, BLOCK_M=_pow2(m), BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps)
    return out


def gemm_config(m: int, n: int, k: int, group_k: int | None = None) -> tuple[int, ...]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages)``: row tiles that follow
    ``m`` up to 64, then 128; ``BLOCK_K`` within one activation group for fp8."""
    block_m = min(128, max(16, _pow2(m)))
    block_k = 128 if group_k is None else min(128, group_k)
    return block_m, 128 if block_m >= 64 else 64, block_k, 8, 4, 3


@triton.jit
def _gemm_8bit_kernel(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr, M, N, K,
                      stride_am, stride_wn, stride_asm, stride_wsn, stride_om, scale_block_n,
                      FP8: tl.constexpr, GROUP_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      GROUP_M: tl.constexpr):
    """``FP8``: ``a`` e4m3 with ``a_scale [M, ceil(K/GROUP_K)]``, ``w`` e4m3 with
    ``w_scale [ceil(N/bn), ceil(K/GROUP_K)]``, ``BLOCK_K`` dividing ``GROUP_K``. Else ``a`` in
    the output dtype, ``w`` int8 with ``w_scale [N]``."""
    pid = tl.program_id(0)
    num_m, num_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = pid // per_group * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + pid % per_group % group_rows
    pid_n = pid % per_group // group_rows
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_mask, col_mask = rows < M, cols < N
    a_ptrs = a_ptr + rows[:, None].to(tl.int64) * stride_am + ks[None, :]  # [BM, BK]
    w_ptrs = w_ptr + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]  # [BK, BN]: w^T
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_mask = ks < K - k
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        if FP8:
            group = k // GROUP_K
            a_s = tl.load(a_scale_ptr + rows * stride_asm + group, mask=row_mask, other=0.0)
            w_s = tl.load(w_scale_ptr + (cols // scale_block_n) * stride_wsn + group,
                          mask=col_mask, other=0.0)
            acc += tl.dot(a, w) * a_s[:, None] * w_s[None, :]
        else:
            acc = tl.dot(a, w.to(a.dtype), acc)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if not FP8:
        acc *= tl.load(w_scale_ptr + cols, mask=col_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + rows[:, None] * stride_om + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & col_mask[None, :])


def _launch_gemm(a, a_scale, weight, w_scale, bias, out, fp8, group_k, scale_block_n, config):
    (m, k), n = a.shape, weight.shape[0]
    block_m, block_n, block_k, group_m, warps, stages = config
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _gemm_8bit_kernel[grid](
        a, a_scale, weight, w_scale, bias, out, m, n, k, a.stride(0), weight.stride(0),
        a_scale.stride(0) if fp8 else 0, w_scale.stride(0) if fp8 else 0, out.stride(0),
        scale_block_n, FP8=fp8, GROUP_K=group_k, HAS_BIAS=bias is not None, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m, num_warps=warps, num_stages=stages)
    return out


def w8a16_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
               bias: torch.Tensor | None, config: tuple[int, ...] | None = None
               ) -> torch.Tensor:
    """``x [M, K]`` (rows contiguous) @ ``(weight [N, K] int8 * scale [N])``^T + ``bias`` ->
    ``[M, N]`` in ``x.dtype``."""
    (m, k), n = x.shape, weight.shape[0]
    out = x.new_empty(m, n)
    return _launch_gemm(x, scale, weight, scale, bias, out, False, 1, 1,
                        config or gemm_config(m, n, k))


@triton.jit
def _fp8_group_quant_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, stride_sm,
                            GROUP: tl.constexpr):
    """One program per (row, group of ``GROUP`` columns): ``scale = max(amax / 448, tiny)``,
    ``q = clamp(x / scale)`` in e4m3."""
    row, group = tl.program_id(0), tl.program_id(1)
    cols = group * GROUP + tl.arange(0, GROUP)
    mask = cols < K
    x = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0) / FP8_MAX_C, MIN_SCALE_C)
    q = tl.clamp(x / scale, -FP8_MAX_C, FP8_MAX_C)
    tl.store(q_ptr + row * stride_qm + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * stride_sm + group, scale)


def fp8_group_quant(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` (rows contiguous) -> ``(q [M, K] e4m3, scale [M, ceil(K/group)] fp32)``,
    as ``quant.quantize_fp8_groups``; ``group`` a power of two."""
    m, k = x.shape
    q = torch.empty(m, k, dtype=FP8_DTYPE, device=x.device)
    groups = triton.cdiv(k, group)
    scale = torch.empty(m, groups, dtype=torch.float32, device=x.device)
    if m:
        _fp8_group_quant_kernel[(m, groups)](x, q, scale, k, x.stride(0), q.stride(0),
                                             scale.stride(0), GROUP=group)
    return q, scale


def fp8_block_gemm(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor,
                   scale_inv: torch.Tensor, bias: torch.Tensor | None, block: tuple[int, int],
                   out_dtype: torch.dtype, config: tuple[int, ...] | None = None
                   ) -> torch.Tensor:
    """``xq [M, K]`` e4m3 with ``x_scale [M, ceil(K/bk)]`` @ ``(weight [N, K] e4m3 *
    scale_inv)``^T + ``bias`` -> ``[M, N]`` in ``out_dtype``."""
    (m, k), n = xq.shape, weight.shape[0]
    config = config or gemm_config(m, n, k, block[1])
    if block[1] % config[2]:
        raise ValueError(f"BLOCK_K {config[2]} must divide the scale block {block[1]}")
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    return _launch_gemm(xq, x_scale, weight, scale_inv, bias, out, True, block[1], block[0],
                        config)
