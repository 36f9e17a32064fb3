"""Triton residual add + RMSNorm fused with the GEMV that projects its output (the
``add_rms_norm_linear`` op; reference ``qllm.ops.linear``): in a decode step, the norm after
a layer's attention and the MoE router's projection as one kernel instead of two.

Every program adds and normalises the whole input rows itself (``x`` and the residual, one
2,048-wide bf16 row each in W3: 8 KB from L2, next to its 8 KB weight tile), then projects
them through its ``BLOCK_N`` weight rows, reduced at once (the GEMV's ``WHOLE_K`` tile,
``triton_gemv``: the launch configs are the GEMV's and must cover all of K). Program 0 also
stores the normed rows (the experts read them) and the sums (the residual stream). The norm's
casts are ``triton_norm``'s (the reference's): the sum in fp32 rounded once, ``x_hat`` in fp32,
the normed rows rounded to the input dtype before the projection multiplies them in fp32, as
the GEMV does its input.

With programmatic dependent launch (``qllm.plugins.pdl``, small decode steps) a program first
lets the next kernel launch, reads its weight tile and the norm's weight (parameters), then
waits for the previous kernel before it reads ``x`` (that kernel's output) and the residual
(an earlier one's) or stores anything.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qllm.plugins.pdl import launch_options, pdl_release, pdl_wait, use_pdl
from qllm_kernels_linear.configs import MAX_GEMV_ROWS, GemvConfig, block_m
from qllm_kernels_linear.triton_norm import rms_normed


# N only bounds the rows, so a new N needs no new compile (as in the GEMV).
@triton.jit(do_not_specialize=["N"])
def _add_rms_norm_gemv_kernel(x_ptr, residual_ptr, norm_w_ptr, w_ptr, out_ptr, normed_ptr,
                              sum_ptr, eps, M, N, K, stride_xm, stride_rm, stride_wn,
                              stride_om, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                              BLOCK_K: tl.constexpr, ZERO_CENTERED: tl.constexpr,
                              USE_PDL: tl.constexpr):
    offs_m = tl.arange(0, BLOCK_M)                                   # [BM]
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)      # [BN]
    offs_k = tl.arange(0, BLOCK_K)[None, None, :]                    # [1, 1, BK]
    cols = offs_k < K
    row_mask = (offs_m[:, None, None] < M) & cols                    # [BM, 1, BK]
    pdl_release(USE_PDL)
    w_rows = offs_n[None, :, None]                                   # [1, BN, 1]
    w = tl.load(w_ptr + w_rows.to(tl.int64) * stride_wn + offs_k, mask=(w_rows < N) & cols,
                other=0.0, eviction_policy="evict_first")            # [1, BN, BK]
    norm_w = tl.load(norm_w_ptr + offs_k, mask=cols, other=0.0).to(tl.float32)  # [1, 1, BK]
    pdl_wait(USE_PDL)  # x is the previous kernel's output, the residual an earlier one's
    x = tl.load(x_ptr + offs_m[:, None, None] * stride_xm + offs_k, mask=row_mask, other=0.0)
    residual = tl.load(residual_ptr + offs_m[:, None, None] * stride_rm + offs_k,
                       mask=row_mask, other=0.0)                     # [BM, 1, BK]
    summed = (x.to(tl.float32) + residual.to(tl.float32)).to(residual.dtype)
    normed = rms_normed(summed, norm_w, eps, K, ZERO_CENTERED)        # [BM, 1, BK]
    first = row_mask & (tl.program_id(0) == 0)  # one program stores the rows
    rows_out = offs_m[:, None, None] * K + offs_k                    # [BM, 1, BK]
    tl.store(normed_ptr + rows_out, normed, mask=first)
    tl.store(sum_ptr + rows_out, summed, mask=first)
    out = tl.sum(normed.to(tl.float32) * w.to(tl.float32), axis=2)  # [BM, BN]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :],
             out.to(out_ptr.dtype.element_ty),
             mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def fuses(rows: int, k: int, config: GemvConfig) -> bool:
    """Whether the fused kernel serves ``rows`` rows of ``k`` features at the GEMV's
    ``config``: the rows the GEMV serves, its tile covering all of K."""
    return 1 <= rows <= MAX_GEMV_ROWS and config.BLOCK_K >= k


def add_rms_norm_gemv(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                      eps: float, zero_centered: bool, weight: torch.Tensor,
                      config: GemvConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x``, ``residual [M, K]`` (unit last strides), ``norm_weight [K]`` and ``weight [N, K]``
    (contiguous rows), one dtype, at a ``config`` that ``fuses`` -> ``(out [M, N], normed
    [M, K], summed [M, K])`` as ``qllm.ops.linear.add_rms_norm_linear``."""
    (m, k), n = residual.shape, weight.shape[0]
    if (x.shape != residual.shape or norm_weight.shape != (k,) or weight.dim() != 2
            or weight.shape[1] != k):
        raise ValueError(f"add_rms_norm_gemv: x and residual [M, K], norm_weight [K] and "
                         f"weight [N, K] expected, got {tuple(x.shape)}, "
                         f"{tuple(residual.shape)}, {tuple(norm_weight.shape)} and "
                         f"{tuple(weight.shape)}")
    if x.stride(1) != 1 or residual.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"add_rms_norm_gemv needs unit last strides, got {x.stride()}, "
                         f"{residual.stride()} and {weight.stride()}")
    if not x.dtype == residual.dtype == norm_weight.dtype == weight.dtype:
        raise ValueError(f"add_rms_norm_gemv: one dtype expected, got {x.dtype}, "
                         f"{residual.dtype}, {norm_weight.dtype} and {weight.dtype}")
    if not fuses(m, k, config):
        raise ValueError(f"add_rms_norm_gemv serves 1 to {MAX_GEMV_ROWS} rows with BLOCK_K >= "
                         f"K, got {m} rows, K = {k}, {config}")
    out = x.new_empty(m, n)
    normed, summed = x.new_empty(m, k), x.new_empty(m, k)
    pdl = use_pdl(x.device, m)
    _add_rms_norm_gemv_kernel[(triton.cdiv(n, config.BLOCK_N),)](
        x, residual, norm_weight, weight, out, normed, summed, eps, m, n, k, x.stride(0),
        residual.stride(0), weight.stride(0), out.stride(0), BLOCK_M=block_m(m),
        BLOCK_N=config.BLOCK_N, BLOCK_K=config.BLOCK_K, ZERO_CENTERED=zero_centered,
        USE_PDL=pdl, num_warps=config.num_warps, num_stages=1, **launch_options(pdl))
    return out, normed, summed
