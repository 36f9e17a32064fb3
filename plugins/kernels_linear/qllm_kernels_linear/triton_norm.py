"""Triton residual add + RMSNorm (the ``add_rms_norm`` op; reference ``qllm.ops.norm``): the
norm before each projection of a decoder layer, one program per row. The branch output added
may come in parts (the MoE's per-slot outputs): summed here, in the same pass.

It takes the place of the kernel Inductor fuses from the same add and norm under
``torch.compile`` (``benchmarks/bench_norms.py`` times both). The casts follow the reference:
the add in fp32 rounded once, ``x_hat`` in fp32, a plain weight multiplying ``x_hat`` rounded
to the input dtype, a zero-centred one multiplying in fp32.

In small decode steps (``qllm.plugins.pdl``, at most ``PDL_MAX_ROWS`` rows) it is launched with
programmatic dependent launch: it reads the norm's weight (loaded after the row's first
reduction otherwise), then waits for the previous kernel (``qllm.plugins.pdl.pdl_wait``). At
most ``FEW_ROWS`` rows a program has 16 warps rather than 4: in W3's one-token step the add +
norm after the MoE (its nine slot outputs and the residual, 40 KB for one program) then ends
3.8 instead of 4.6 us after the MoE, 358.6 against 354.2 tok/s on an H100 (8 warps: 3.9 us;
two runs of each, alternated in one call, 2026-12-06).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qllm.plugins.pdl import pdl_arguments, pdl_release, pdl_wait

NUM_WARPS = 4
# ... and in steps of at most FEW_ROWS rows, where a row's loads are the kernel's latency
FEW_ROWS, FEW_ROWS_NUM_WARPS = 16, 16


@triton.jit
def _add_rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, sum_ptr, eps,
                         stride_x, stride_x_part, stride_residual, PARTS: tl.constexpr,
                         D: tl.constexpr, BLOCK_D: tl.constexpr, ZERO_CENTERED: tl.constexpr,
                         USE_PDL: tl.constexpr):
    pdl_release(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    dims = tl.arange(0, BLOCK_D)  # [D]
    mask = dims < D
    weight = tl.load(weight_ptr + dims, mask=mask, other=0.0).to(tl.float32)  # a parameter
    pdl_wait(USE_PDL)  # x is the previous kernel's output, the residual an earlier one's
    residual = tl.load(residual_ptr + row * stride_residual + dims, mask=mask, other=0.0)
    x = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for part in tl.static_range(PARTS):  # x's parts in order, then the residual, in fp32
        x += tl.load(x_ptr + row * stride_x + part * stride_x_part + dims, mask=mask,
                     other=0.0).to(tl.float32)
    summed = (x + residual.to(tl.float32)).to(residual.dtype)  # [D]
    tl.store(sum_ptr + row * D + dims, summed, mask=mask)
    out = rms_normed(summed, weight, eps, D, ZERO_CENTERED)
    tl.store(out_ptr + row * D + dims, out, mask=mask)


@triton.jit
def rms_normed(summed, weight, eps, D, ZERO_CENTERED: tl.constexpr):
    """RMSNorm of ``summed [..., BLOCK_D]`` (rows of ``D`` features, the padding zeros) over its
    last axis, in ``summed``'s dtype, with the reference's casts: ``x_hat`` in fp32; a plain
    ``weight`` (fp32, ``[BLOCK_D]`` broadcast) multiplying ``x_hat`` rounded to that dtype, a
    zero-centred one multiplying in fp32."""
    s = summed.to(tl.float32)
    x_hat = s * tl.rsqrt(tl.sum(s * s, axis=len(s.shape) - 1, keep_dims=True) / D + eps)
    if ZERO_CENTERED:
        return (x_hat * (1.0 + weight)).to(summed.dtype)
    return (weight * x_hat.to(summed.dtype).to(tl.float32)).to(summed.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 zero_centered: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual [T, D]``, ``x`` as ``[T, D]`` or in parts ``[T, S, D]`` (unit last strides,
    any other strides) and ``weight [D]``, one dtype -> ``(normed, x + residual)``, both
    ``[T, D]`` contiguous, the parts summed in order."""
    partials = x.unsqueeze(1) if x.dim() == 2 else x  # [T, S, D]
    if (partials.dim() != 3 or residual.shape != partials.shape[::2]
            or weight.shape != residual.shape[1:]):
        raise ValueError(f"add_rms_norm: residual [T, D], x [T, D] or [T, S, D] and weight "
                         f"[D] expected, got {tuple(residual.shape)}, {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if partials.stride(2) != 1 or residual.stride(1) != 1:
        raise ValueError(f"add_rms_norm needs unit last strides, got {x.stride()} and "
                         f"{residual.stride()}")
    if not x.dtype == residual.dtype == weight.dtype:
        raise ValueError(f"add_rms_norm: one dtype expected, got {x.dtype}, {residual.dtype} "
                         f"and {weight.dtype}")
    rows, parts, dim = partials.shape
    out, summed = residual.new_empty(rows, dim), residual.new_empty(rows, dim)
    if rows:
        _add_rms_norm_kernel[(rows,)](
            partials, residual, weight, out, summed, eps, partials.stride(0),
            partials.stride(1), residual.stride(0), PARTS=parts, D=dim,
            BLOCK_D=triton.next_power_of_2(dim), ZERO_CENTERED=zero_centered,
            num_warps=FEW_ROWS_NUM_WARPS if rows <= FEW_ROWS else NUM_WARPS,
            **pdl_arguments(residual.device, rows))
    return out, summed
