"""Triton kernels of the 8-bit dense projections beyond the GEMV's rows (``triton_gemv``):
``out [M, N] = x [M, K] @ w[N, K]^T (+ bias)``.

- ``w8a16_gemm`` (int8): tiles of ``x`` times int8 weight tiles converted to ``x.dtype``
  (exact: |q| <= 127) on the tensor cores, the per-row scale in the epilogue.
- ``fp8_group_quant`` + ``fp8_block_gemm`` (fp8): ``x`` quantized to e4m3 per token and group
  of ``bk`` columns, then an fp8 x fp8 tensor-core GEMM whose ``BLOCK_K`` steps each lie in
  one group: ``acc += dot(a, w) * a_scale[m] * w_scale[n // bn]``.

Launch parameters are a rule, not yet measured (``gemm_config``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qllm_kernels_linear.configs import next_power_of_2
from qllm_kernels_moe.triton_moe import grouped_tile

from qllm_kernels_int8.quant import FP8_DTYPE, FP8_MAX, MIN_SCALE

FP8_MAX_C = tl.constexpr(FP8_MAX)
MIN_SCALE_C = tl.constexpr(MIN_SCALE)


def gemm_config(m: int, n: int, k: int, group_k: int | None = None) -> tuple[int, ...]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages)``: row tiles that follow
    ``m`` up to 64, then 128; ``BLOCK_K`` within one activation group for fp8."""
    block_m = min(128, max(16, next_power_of_2(m)))
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
    pid_m, pid_n = grouped_tile(pid, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
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


def gemm_8bit_args(a, a_scale, weight, w_scale, bias, out, fp8, group_k, scale_block_n,
                   config) -> dict:
    """``_gemm_8bit_kernel``'s arguments by name (``config``: ``gemm_config``'s tuple)."""
    (m, k), n = a.shape, weight.shape[0]
    block_m, block_n, block_k, group_m, _, _ = config
    return dict(a_ptr=a, a_scale_ptr=a_scale, w_ptr=weight, w_scale_ptr=w_scale, bias_ptr=bias,
                out_ptr=out, M=m, N=n, K=k, stride_am=a.stride(0), stride_wn=weight.stride(0),
                stride_asm=a_scale.stride(0) if fp8 else 0,
                stride_wsn=w_scale.stride(0) if fp8 else 0, stride_om=out.stride(0),
                scale_block_n=scale_block_n, FP8=fp8, GROUP_K=group_k,
                HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                GROUP_M=group_m)


def _launch_gemm(a, a_scale, weight, w_scale, bias, out, fp8, group_k, scale_block_n, config):
    (m, _), n = a.shape, weight.shape[0]
    block_m, block_n, _, _, warps, stages = config
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _gemm_8bit_kernel[grid](**gemm_8bit_args(a, a_scale, weight, w_scale, bias, out, fp8,
                                             group_k, scale_block_n, config),
                            num_warps=warps, num_stages=stages)
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
