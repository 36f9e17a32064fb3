"""Triton residual add + RMSNorm (the ``add_rms_norm`` op; reference ``qllm.ops.norm``): the
norm before each projection of a decoder layer, one program per row.

It takes the place of the kernel Inductor fuses from the same add and norm under
``torch.compile`` (``benchmarks/bench_norms.py`` times both). The casts follow the reference:
the add in fp32 rounded once, ``x_hat`` in fp32, a plain weight multiplying ``x_hat`` rounded
to the input dtype, a zero-centred one multiplying in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

NUM_WARPS = 4


@triton.jit
def _add_rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, sum_ptr, eps,
                         stride_x, stride_residual, D: tl.constexpr, BLOCK_D: tl.constexpr,
                         ZERO_CENTERED: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    dims = tl.arange(0, BLOCK_D)  # [D]
    mask = dims < D
    x = tl.load(x_ptr + row * stride_x + dims, mask=mask, other=0.0)
    residual = tl.load(residual_ptr + row * stride_residual + dims, mask=mask, other=0.0)
    weight = tl.load(weight_ptr + dims, mask=mask, other=0.0).to(tl.float32)
    summed = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)  # [D]
    tl.store(sum_ptr + row * D + dims, summed, mask=mask)
    s = summed.to(tl.float32)
    x_hat = s * tl.rsqrt(tl.sum(s * s, axis=0) / D + eps)
    if ZERO_CENTERED:
        out = x_hat * (1.0 + weight)
    else:
        out = weight * x_hat.to(x.dtype).to(tl.float32)
    tl.store(out_ptr + row * D + dims, out.to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 zero_centered: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``x``, ``residual [T, D]`` (unit last stride, any row stride) and ``weight [D]``, one
    dtype -> ``(normed, x + residual)``, both ``[T, D]`` contiguous."""
    if x.dim() != 2 or residual.shape != x.shape or weight.shape != x.shape[1:]:
        raise ValueError(f"add_rms_norm: x and residual [T, D] and weight [D] expected, got "
                         f"{tuple(x.shape)}, {tuple(residual.shape)} and {tuple(weight.shape)}")
    if x.stride(1) != 1 or residual.stride(1) != 1:
        raise ValueError(f"add_rms_norm needs unit last strides, got {x.stride()} and "
                         f"{residual.stride()}")
    if not x.dtype == residual.dtype == weight.dtype:
        raise ValueError(f"add_rms_norm: one dtype expected, got {x.dtype}, {residual.dtype} "
                         f"and {weight.dtype}")
    rows, dim = x.shape
    out, summed = x.new_empty(rows, dim), x.new_empty(rows, dim)
    if rows:
        _add_rms_norm_kernel[(rows,)](
            x, residual, weight, out, summed, eps, x.stride(0), residual.stride(0), D=dim,
            BLOCK_D=triton.next_power_of_2(dim), ZERO_CENTERED=zero_centered, num_warps=NUM_WARPS)
    return out, summed
