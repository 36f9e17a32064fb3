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
output rounded once to ``x.dtype``, as ``F.linear`` does. Rows past ``M`` load row ``M - 1``
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
    step, warps, and pipelined loop stages."""

    BLOCK_N: int
    BLOCK_K: int
    num_warps: int
    num_stages: int


def block_m(m: int) -> int:
    """The dot's input-row block for ``m`` rows: a power of two, at least ``MIN_DOT``."""
    return max(MIN_DOT, triton.next_power_of_2(m))


def default_config(m: int, n: int, k: int) -> SkinnyConfig:
    """The rule: the largest ``BLOCK_N`` of 64, 32, 16 that still gives ``MIN_PROGRAMS``
    programs (16 where none does), 128 columns per step over 4 stages on 4 warps."""
    block_n = next((b for b in (64, 32) if triton.cdiv(n, b) >= MIN_PROGRAMS), MIN_DOT)
    return SkinnyConfig(block_n, min(128, max(MIN_DOT, triton.next_power_of_2(k))), 4, 4)


@triton.jit(do_not_specialize=["M"])
def _skinny_gemm_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_wn,
                        stride_om, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program ``n``: ``out[:, n * BLOCK_N ...]`` over all of K."""
    rows_w = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)         # [BN] weight rows
    rows_x = tl.arange(0, BLOCK_M)                                      # [BM] input rows
    ks = tl.arange(0, BLOCK_K)                                          # [BK]
    w_ptrs = (w_ptr + tl.minimum(rows_w, N - 1)[:, None].to(tl.int64) * stride_wn
              + ks[None, :])                                            # [BN, BK]
    x_ptrs = x_ptr + tl.minimum(rows_x, M - 1)[None, :] * stride_xm + ks[:, None]  # [BK, BM]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)                # out^T tile
    for k in range(0, K, BLOCK_K):
        in_k = ks < K - k
        w = tl.load(w_ptrs, mask=in_k[None, :], other=0.0, eviction_policy="evict_first")
        x = tl.load(x_ptrs, mask=in_k[:, None], other=0.0, eviction_policy="evict_last")
        acc = tl.dot(w, x, acc)                                         # [BN, BM]
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    w_on, x_on = rows_w < N, rows_x < M
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows_w, mask=w_on, other=0.0).to(tl.float32)[:, None]
    out_ptrs = out_ptr + rows_x[None, :] * stride_om + rows_w[:, None]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=w_on[:, None] & x_on[None, :])


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
    out = x.new_empty(m, n)
    _skinny_gemm_kernel[(triton.cdiv(n, config.BLOCK_N),)](
        x, weight, bias, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_N=config.BLOCK_N, BLOCK_M=block_m(m),
        BLOCK_K=config.BLOCK_K, num_warps=config.num_warps, num_stages=config.num_stages)
    return out
