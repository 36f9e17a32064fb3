"""The gated RMSNorm that closes a Gated DeltaNet layer (contract and reference:
``qllm.ops.norm``), one Triton kernel.

Left to ``torch.compile``, the decode graph ran it as two kernels, a persistent reduction for
the variance and a pointwise kernel for the rest (5.0 + 3.3 us per layer at W2's batch 200,
1.3 + 1.4 us at batch 1). Here one program normalises ``BLOCK_R`` rows of ``D`` (a row is one
value head of one token) and applies weight and gate, with transformers' casts: ``x_hat`` in
fp32, cast to the input dtype, times the weight in that dtype, times ``silu(gate)`` in fp32. In
small decode steps (``qllm.plugins.pdl``, at most ``PDL_MAX_ROWS`` rows) it is launched with
programmatic dependent launch: it reads its weight, then waits for the previous kernel
(``qllm.plugins.pdl.pdl_wait``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qllm.plugins.pdl import pdl_arguments, pdl_release, pdl_wait

ELEMENTS_PER_PROGRAM = 2048  # rows per program: this many elements over the row length
NUM_WARPS = 4


@triton.jit
def gated_rms_norm(x, gate, weight, eps, D: tl.constexpr):
    """``rms_norm_gated`` over the last axis of ``x [..., BLOCK_D]`` (zero past ``D``), with
    ``gate`` of its shape and the plain ``weight [BLOCK_D]``, in transformers' casts:
    ``x_hat`` in fp32 rounded to ``x``'s dtype, times the weight in fp32 rounded, times
    ``silu(gate)`` in fp32 -> fp32. The norm's kernel and the recurrence's (``NORM``) share it."""
    x32 = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x32 * x32, axis=-1, keep_dims=True) / D + eps)  # [..., 1]
    x_hat = (x32 * inv_rms).to(x.dtype)
    weighted = (weight.to(tl.float32) * x_hat.to(tl.float32)).to(x.dtype)
    gate = gate.to(tl.float32)
    return weighted.to(tl.float32) * (gate * tl.sigmoid(gate))


@triton.jit
def _rms_norm_gated_kernel(x_ptr, gate_ptr, weight_ptr, out_ptr, rows, heads, eps,
                           stride_x_tok, stride_x_head, stride_g_tok, stride_g_head,
                           D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                           USE_PDL: tl.constexpr):
    pdl_release(USE_PDL)
    row = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [R]: (token, head) pairs
    dims = tl.arange(0, BLOCK_D)  # [D]
    mask = (row < rows)[:, None] & (dims < D)[None, :]  # [R, D]
    weight = tl.load(weight_ptr + dims, mask=dims < D, other=0.0)  # [D], a parameter
    pdl_wait(USE_PDL)  # x is the recurrence's output, the gate the in_proj's
    token, head = (row // heads).to(tl.int64), row % heads
    x_rows = x_ptr + token * stride_x_tok + head * stride_x_head  # [R]
    gate_rows = gate_ptr + token * stride_g_tok + head * stride_g_head  # [R]
    x = tl.load(x_rows[:, None] + dims[None, :], mask=mask, other=0.0)  # [R, D]
    gate = tl.load(gate_rows[:, None] + dims[None, :], mask=mask, other=0.0)
    out = gated_rms_norm(x, gate, weight, eps, D)  # [R, D]
    tl.store(out_ptr + row.to(tl.int64)[:, None] * D + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_gated(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                   eps: float) -> torch.Tensor:
    """``x``, ``gate [T, H, D]`` (unit last stride, any token and head strides), ``weight
    [D]`` in ``x``'s dtype -> ``[T, H, D]`` contiguous."""
    tokens, heads, dim = x.shape
    out = torch.empty(tokens, heads, dim, dtype=x.dtype, device=x.device)
    block_d = triton.next_power_of_2(dim)
    block_r = max(1, ELEMENTS_PER_PROGRAM // block_d)
    rows = tokens * heads
    if rows == 0:
        return out
    _rms_norm_gated_kernel[(triton.cdiv(rows, block_r),)](
        x, gate, weight, out, rows, heads, eps,
        x.stride(0), x.stride(1), gate.stride(0), gate.stride(1),
        D=dim, BLOCK_R=block_r, BLOCK_D=block_d, num_warps=NUM_WARPS,
        **pdl_arguments(x.device, tokens))
    return out
