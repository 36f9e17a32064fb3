"""The L2 norm of the q and k heads before fla's chunked prefill (``fla_chunk``), one Triton
kernel with no autotuning: ``x * rsqrt(sum(x^2) + eps)`` over each head's values, in fp32,
rounded once to ``x``'s dtype (fla's ``l2norm_fwd`` arithmetic; reference:
``qllm.ops.gdn.l2norm``).

fla normalises in its chunked kernel's entry (``use_qk_l2norm_in_kernel``) with an autotuned
kernel: 25 configs per key, the key a bucket of 65,536 rows, so a cold W2 start compiled and
benchmarked it 100 times over the warm-up's prefill sizes (24.3 s of compiling one config at a
time on the H200, 2026-12-03), and it first copies the conv output's q and k slices into
contiguous tensors. Here one program normalises ``BLOCK_R`` (token, head) rows of a strided
``[T, H, D]`` view straight into a contiguous output; the row count is not specialised, so a
dtype compiles once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qllm.ops.gdn import L2NORM_EPS

ELEMENTS_PER_PROGRAM = 4096  # rows per program: this many elements over the head dim
NUM_WARPS = 4


@triton.jit(do_not_specialize=["rows"])
def _l2norm_kernel(x_ptr, out_ptr, rows, heads, eps, stride_tok, stride_head,
                   D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [R]: (token, head) pairs
    dims = tl.arange(0, BLOCK_D)  # [D]
    mask = (row < rows)[:, None] & (dims < D)[None, :]  # [R, D]
    token, head = (row // heads).to(tl.int64), row % heads
    x_rows = x_ptr + token * stride_tok + head * stride_head  # [R]
    x = tl.load(x_rows[:, None] + dims[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = 1 / tl.sqrt(tl.sum(x * x, axis=1) + eps)  # [R]
    out_rows = out_ptr + row.to(tl.int64) * D  # [R]
    tl.store(out_rows[:, None] + dims[None, :],
             (x * rstd[:, None]).to(out_ptr.dtype.element_ty), mask=mask)


def l2norm_heads(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """``x [T, H, D]`` (unit last stride, any token and head strides) -> its L2-normalised
    heads, ``[T, H, D]`` contiguous in ``x.dtype``."""
    tokens, heads, dim = x.shape
    if x.stride(-1) != 1:
        raise ValueError(f"l2norm_heads needs a unit last stride, got strides {x.stride()}")
    out = torch.empty(tokens, heads, dim, dtype=x.dtype, device=x.device)
    rows = tokens * heads
    if rows == 0:
        return out
    block_d = triton.next_power_of_2(dim)
    block_r = max(1, ELEMENTS_PER_PROGRAM // block_d)
    _l2norm_kernel[(triton.cdiv(rows, block_r),)](
        x, out, rows, heads, eps, x.stride(0), x.stride(1),
        D=dim, BLOCK_R=block_r, BLOCK_D=block_d, num_warps=NUM_WARPS)
    return out
