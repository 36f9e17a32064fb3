"""Triton GEMM for a few rows: ``out [M, N] = x [M, K] @ weight [N, K]^T (+ bias)`` for ``M``
of ``MAX_GEMV_ROWS + 1`` to ``MAX_SKINNY_ROWS``, computed as ``out^T = weight @ x^T``.

At these rows a decode step's projections are bound by reading their weights, yet cuBLAS ran
them far from it: W1's (Qwen3-0.6B) four projections per layer took 0.88 ms of a 2.43 ms
16-sequence step on an H100 (1.2 GB of weights, 0.36 ms at its 3.35 TB/s; session 30's
profile). Here each program owns ``BLOCK_N`` weight rows and streams them once, ``BLOCK_K``
columns per step through ``num_stages`` pipelined loads (``evict_first``: nothing reads them
again in the step), as the A operand of a tensor-core dot whose B is ``x^T`` (all ``M`` rows,
padded to ``BLOCK_M >= 16``, the dot's smallest); the weight rows are the MMA's M, so ``M``
rows cost one MMA column block. Products accumulate in fp32; the bias is added in fp32 and the
output rounded once to ``x.dtype``, as ``F.linear`` does. Where the weight has too few row
blocks to fill the GPU (1,024 output features), ``SPLIT_K`` programs share each block's K,
writing fp32 partial sums that a second launch adds (with the bias) and rounds once. Rows past
``M`` load row ``M - 1``
and are not stored; weight rows past ``N`` likewise. The launch depends on shapes only (no
host sync): it runs inside CUDA graphs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from qllm_kernels_linear.configs import MAX_SKINNY_ROWS

MIN_DOT = 16  # the tensor-core dot's smallest dimension
MIN_PROGRAMS = 128  # about one program per SM (132 on the H100 and H200)


@dataclass(frozen=True)
class SkinnyConfig:
    """Launch parameters: ``BLOCK_N`` weight rows per program, ``BLOCK_K`` columns per loop
    step, warps, pipelined loop stages, and ``SPLIT_K`` programs sharing each row block's K
    (above 1, their fp32 partial sums are added by a second launch)."""

    BLOCK_N: int
    BLOCK_K: int
    num_warps: int
    num_stages: int
    SPLIT_K: int = 1


def block_m(m: int) -> int:
    """The dot's input-row block for ``m`` rows: a power of two, at least ``MIN_DOT``."""
    return max(MIN_DOT, triton.next_power_of_2(m))


def default_config(m: int, n: int, k: int) -> SkinnyConfig:
    """The rule: the largest ``BLOCK_N`` of 64, 32, 16 that still gives ``MIN_PROGRAMS``
    programs, else 16 rows with K split over enough programs to reach it (at most 4 ways);
    128 columns per step over 4 stages on 4 warps."""
    block_k = min(128, max(MIN_DOT, triton.next_power_of_2(k)))
    block_n = next((b for b in (64, 32) if triton.cdiv(n, b) >= MIN_PROGRAMS), MIN_DOT)
    split = 1
    while (split < 4 and triton.cdiv(n, block_n) * split < MIN_PROGRAMS
           and triton.cdiv(k, block_k) >= 2 * split * 2):
        split *= 2
    return SkinnyConfig(block_n, block_k, 4, 4, split)


@triton.jit(do_not_specialize=["M"])
def _skinny_gemm_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_wn,
                        stride_om, stride_split, k_per_split, HAS_BIAS: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program ``(n, s)``: ``out[:, n * BLOCK_N ...]`` over K columns ``[s * k_per_split,
    (s + 1) * k_per_split)`` (a multiple of ``BLOCK_K``), written at ``out_ptr + s *
    stride_split`` (fp32 partial sums when K is split)."""
    rows_w = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)         # [BN] weight rows
    rows_x = tl.arange(0, BLOCK_M)                                      # [BM] input rows
    k_start = tl.program_id(1) * k_per_split
    ks = k_start + tl.arange(0, BLOCK_K)                                # [BK]
    w_ptrs = (w_ptr + tl.minimum(rows_w, N - 1)[:, None].to(tl.int64) * stride_wn
              + ks[None, :])                                            # [BN, BK]
    x_ptrs = x_ptr + tl.minimum(rows_x, M - 1)[None, :] * stride_xm + ks[:, None]  # [BK, BM]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)                # out^T tile
    for k in range(k_start, tl.minimum(K, k_start + k_per_split), BLOCK_K):
        in_k = ks < K - (k - k_start)
        w = tl.load(w_ptrs, mask=in_k[None, :], other=0.0, eviction_policy="evict_first")
        x = tl.load(x_ptrs, mask=in_k[:, None], other=0.0, eviction_policy="evict_last")
        acc = tl.dot(w, x, acc)                                         # [BN, BM]
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    w_on, x_on = rows_w < N, rows_x < M
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows_w, mask=w_on, other=0.0).to(tl.float32)[:, None]
    out_ptrs = (out_ptr + tl.program_id(1) * stride_split + rows_x[None, :] * stride_om
                + rows_w[:, None])
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=w_on[:, None] & x_on[None, :])


@triton.jit
def _sum_splits_kernel(part_ptr, bias_ptr, out_ptr, MN, N, SPLIT_K: tl.constexpr,
                       HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """Program ``p``: elements ``p * BLOCK ...`` of ``out [M, N]`` (contiguous), the sum of
    the ``SPLIT_K`` fp32 partial sums ``[SPLIT_K, M, N]`` plus the bias, rounded once."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    on = offs < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for split in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + split * MN + offs, mask=on, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=on, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=on)


SUM_BLOCK = 1024  # output elements per program of the split-K sum


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                config: SkinnyConfig | None = None) -> torch.Tensor:
    """``x [M, K]`` (unit column stride) @ ``weight [N, K]^T`` (contiguous rows) + ``bias
    [N]`` -> ``out [M, N]`` in ``x.dtype``, for ``1 <= M <= MAX_SKINNY_ROWS``; one float dtype
    for all inputs. ``config`` overrides the rule (``default_config``)."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"skinny_gemm: x [M, K] and weight [N, K] expected, got "
                         f"{tuple(x.shape)} and {tuple(weight.shape)}")
    (m, k), n = x.shape, weight.shape[0]
    if not 1 <= m <= MAX_SKINNY_ROWS:
        raise ValueError(f"skinny_gemm serves 1 to {MAX_SKINNY_ROWS} rows, got {m}")
    if weight.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError(f"skinny_gemm needs unit column strides, got {x.stride()} and "
                         f"{weight.stride()}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"skinny_gemm: bias of shape {tuple(bias.shape)} for {n} outputs")
    config = config or default_config(m, n, k)
    split = config.SPLIT_K
    out = x.new_empty(m, n)
    target = out if split == 1 else torch.empty(split, m, n, dtype=torch.float32,
                                                device=x.device)  # [S, M, N] partial sums
    steps = triton.cdiv(k, config.BLOCK_K)
    _skinny_gemm_kernel[(triton.cdiv(n, config.BLOCK_N), split)](
        x, weight, bias, target, m, n, k, x.stride(0), weight.stride(0), n, m * n,
        triton.cdiv(steps, split) * config.BLOCK_K, HAS_BIAS=bias is not None and split == 1,
        BLOCK_N=config.BLOCK_N, BLOCK_M=block_m(m), BLOCK_K=config.BLOCK_K,
        num_warps=config.num_warps, num_stages=config.num_stages)
    if split > 1:
        _sum_splits_kernel[(triton.cdiv(m * n, SUM_BLOCK),)](
            target, bias, out, m * n, n, SPLIT_K=split, HAS_BIAS=bias is not None,
            BLOCK=SUM_BLOCK)
    return out
