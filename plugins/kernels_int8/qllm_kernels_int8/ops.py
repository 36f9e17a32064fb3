"""The Triton paths of the 8-bit ops as ``torch.library`` custom ops (``qllm_int8::*``), opaque
to ``torch.compile`` (a fake gives each output's shape, so the decode graph stays whole).
Inside an op the row count is concrete and picks the kernel:

- ``linear_w8a16``: the GEMV (``triton_gemv``) up to ``GEMV_MAX_ROWS`` rows; a Triton W8A16
  GEMM up to ``GEMM_MAX_ROWS`` (decode batches, where reading 1 byte per weight is the gain),
  the swap-AB one (``triton_w8a16``) or the shared-B one (``triton_linear.w8a16_gemm``) as
  ``swap_ab_serves`` says (``INT8_GEMM``); beyond ``GEMM_MAX_ROWS``, the weight dequantized to
  ``x.dtype`` and ``F.linear`` (prefill: compute-bound, the dequantized copy costs 3 bytes per
  weight against ``2 * M`` flops per weight, and cuBLAS's tuned GEMMs beat an untuned Triton
  one). Not yet measured.
- ``linear_fp8_block``: the GEMV (weight-only) up to ``GEMV_MAX_ROWS`` rows; beyond, the
  activations quantized per token and group and the fp8 x fp8 block-scaled GEMM.
- ``fused_moe_w8a16`` / ``fused_moe_fp8_block``: ``triton_moe``.

The kernels are imported on the first real call, so the ops and fakes exist without Triton.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from qllm_kernels_int8 import gemm_configs
from qllm_kernels_int8.gemv_configs import GEMV_MAX_ROWS
from qllm_kernels_int8.quant import dequantize_int8_rows

GEMM_MAX_ROWS = 512
# Which W8A16 GEMM serves 5-512 rows: QLLM_INT8_GEMM = "shared_b" (default: the GEMM checked
# on the GPU), "swap_ab" (every row count) or "auto". The swap-AB GEMM has not run on a GPU
# yet, so it is no default until its CUDA parity tests pass there. "auto" takes it where its
# rule holds the rows in
# one 256-row tile (129-256 rows, W2's 200): there, compiled for sm_90, it does at most the
# shared-B GEMM's MMA flops and x bytes per SM, half its weight loads and conversions, 30%
# fewer instructions per MMA flop, with the MMA asynchronous instead of serialized with the
# loads and conversion (triton_w8a16, benchmarks/sass_w8a16.py). At 128-row tiles (65-128 and
# 257-512 rows) it issues 25-40% more instructions per MMA flop, at 16-64 rows its tiles differ:
# there only a measurement can choose.
INT8_GEMM = os.environ.get("QLLM_INT8_GEMM", "shared_b")
if INT8_GEMM not in ("auto", "swap_ab", "shared_b"):
    raise ValueError(f"QLLM_INT8_GEMM={INT8_GEMM!r}: auto, swap_ab or shared_b")


def swap_ab_serves(rows: int) -> bool:
    """Whether the swap-AB GEMM (rather than the shared-B one) computes ``rows`` rows."""
    return INT8_GEMM == "swap_ab" or (INT8_GEMM == "auto"
                                      and gemm_configs.block_m(rows) == gemm_configs.MAX_BLOCK_M)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


@torch.library.custom_op("qllm_int8::linear_w8a16", mutates_args=())
def linear_w8a16(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                 bias: torch.Tensor | None) -> torch.Tensor:
    """The contract of ``quant.linear_w8a16``."""
    from qllm_kernels_int8 import triton_gemv, triton_linear, triton_w8a16

    x2 = _rows(x)
    rows = x2.shape[0]
    if rows == 0 or rows > GEMM_MAX_ROWS:
        return F.linear(x, dequantize_int8_rows(weight, scale, x.dtype), bias)
    if rows <= GEMV_MAX_ROWS:
        out = triton_gemv.gemv_8bit(x2, weight, scale, bias)
    elif swap_ab_serves(rows):
        out = triton_w8a16.w8a16_gemm_swap_ab(x2, weight, scale, bias)
    else:
        out = triton_linear.w8a16_gemm(x2, weight, scale, bias)
    return out.view(*x.shape[:-1], weight.shape[0])


@linear_w8a16.register_fake
def _linear_w8a16_fake(x, weight, scale, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("qllm_int8::linear_fp8_block", mutates_args=())
def linear_fp8_block(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                     bias: torch.Tensor | None, block_n: int, block_k: int) -> torch.Tensor:
    """The contract of ``quant.linear_fp8_block``; beyond ``GEMV_MAX_ROWS`` rows the
    activations are quantized (W8A8)."""
    from qllm_kernels_int8 import triton_gemv, triton_linear

    x2 = _rows(x)
    rows, block = x2.shape[0], (block_n, block_k)
    if rows == 0:
        return x.new_empty(*x.shape[:-1], weight.shape[0])
    if rows <= GEMV_MAX_ROWS:
        out = triton_gemv.gemv_8bit(x2, weight, scale_inv, bias, block)
    else:
        xq, x_scale = triton_linear.fp8_group_quant(x2, block_k)
        out = triton_linear.fp8_block_gemm(xq, x_scale, weight, scale_inv, bias, block,
                                           x.dtype)
    return out.view(*x.shape[:-1], weight.shape[0])


@linear_fp8_block.register_fake
def _linear_fp8_block_fake(x, weight, scale_inv, bias, block_n, block_k):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("qllm_int8::fused_moe_w8a16", mutates_args=())
def fused_moe_w8a16(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor,
                    w2: torch.Tensor, w2_scale: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, shared_w13: torch.Tensor,
                    shared_w13_scale: torch.Tensor, shared_w2: torch.Tensor,
                    shared_w2_scale: torch.Tensor) -> torch.Tensor:
    """The contract of ``quant.fused_moe_w8a16``."""
    from qllm_kernels_int8.triton_moe import fused_moe_8bit

    return fused_moe_8bit(x, (w13, w13_scale), (w2, w2_scale), topk_weights, topk_ids,
                          (shared_w13, shared_w13_scale), (shared_w2, shared_w2_scale))


@fused_moe_w8a16.register_fake
def _fused_moe_w8a16_fake(x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, *shared):
    return x.new_empty(x.shape[0], topk_ids.shape[1], x.shape[1])


@torch.library.custom_op("qllm_int8::fused_moe_fp8_block", mutates_args=())
def fused_moe_fp8_block(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor,
                        w2: torch.Tensor, w2_scale: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor, shared_w13: torch.Tensor,
                        shared_w13_scale: torch.Tensor, shared_w2: torch.Tensor,
                        shared_w2_scale: torch.Tensor, block_n: int,
                        block_k: int) -> torch.Tensor:
    """The contract of ``quant.fused_moe_fp8_block``, with activations quantized per token
    and group of ``block_k`` (W8A8)."""
    from qllm_kernels_int8.triton_moe import fused_moe_8bit

    return fused_moe_8bit(x, (w13, w13_scale), (w2, w2_scale), topk_weights, topk_ids,
                          (shared_w13, shared_w13_scale), (shared_w2, shared_w2_scale),
                          block=(block_n, block_k))


@fused_moe_fp8_block.register_fake
def _fused_moe_fp8_block_fake(x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids,
                              shared_w13, shared_w13_scale, shared_w2, shared_w2_scale,
                              block_n, block_k):
    return x.new_empty(x.shape[0], topk_ids.shape[1], x.shape[1])
