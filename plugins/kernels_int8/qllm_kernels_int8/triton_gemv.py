"""Triton GEMV on 8-bit weights, ``out [M, N] = x [M, K] @ dequant(w [N, K])^T (+ bias)`` for
``M <= GEMV_MAX_ROWS`` (decode at batch 1-4), and its core, ``weight_row_dots``, which the MoE's
small-batch path (``triton_slot_moe``) shares.

Layout. kernels_linear's bf16 GEMV keeps each thread's weights and the same columns of ``x`` in
the same registers, so the product needs no data movement. With 1-byte weights a 16-byte load
holds 16 columns, while Triton loads bf16 ``x`` 8 columns per thread: the two no longer line up
and ``x`` goes through shared memory, with a barrier, in every loop step. So here each thread
owns chunks of ``VECTOR`` = 8 columns: 8 weights (one 8-byte load per row) and the same 8
columns of each ``x`` row (one 16-byte load), as ``[1, BLOCK_N, C, 8]`` weight and ``[BLOCK_M,
1, C, 8]`` ``x`` tiles (``C = BLOCK_K / 8`` chunks, threads and warps along ``C``).

Reduction. Each chunk's 8 products are summed in registers as soon as they are formed, into an
fp32 ``[BLOCK_M, BLOCK_N, C]`` accumulator (one register per chunk a thread holds, not 8),
reduced over ``C`` once after the loop; so a program can keep twice the bf16 GEMV's weight
elements in flight for the same registers.

Dequantization. int8: ``int8_convert.int8_to_f32``, exact, ``bits(2^23 + 128 + q) - (2^23 +
128)`` (inline PTX on CUDA: an xor per 4 weights, then a ``prmt`` and a subtraction per weight,
because Triton's conversion, ``I2F``, would bound the kernel near the HBM byte rate); the
interpreter computes the same arithmetic elementwise. The row's scale multiplies each output
once, in the epilogue. fp8 (e4m3, weight-only: ``x`` is not quantized): Triton's conversion,
and each chunk's sum times the scale of its ``SCALE_BLOCK_K``-column block (8 divides the
block).

Launch parameters: ``gemv_configs``. The launch depends on shapes only (no host sync).

In small decode steps (``qllm.plugins.pdl``) the GEMV is launched with programmatic dependent
launch, as kernels_linear's bf16 GEMV: it lets the next kernel launch, issues the loads of its
first ``BLOCK_K`` weight columns and their scales (parameters), then waits for the previous
kernel (``gdc_wait``, unconditional) before it loads ``x`` or stores; without it the constexpr
prunes all of that and the kernel compiles to its code without PDL.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from qllm.plugins.pdl import pdl_arguments
from qllm_kernels_linear.configs import GemvConfig, block_m

from qllm_kernels_int8.gemv_configs import GEMV_MAX_ROWS, VECTOR, default_config
from qllm_kernels_int8.int8_convert import int8_to_f32

VECTOR_C = tl.constexpr(VECTOR)


@triton.jit
def _k_step(acc, x_ptrs, x_rows, w_ptrs, w_rows_on, scale_rows, row_mask, chunks, cols, k, K,
            SCALE_BLOCK_K: tl.constexpr, FAST_INT8: tl.constexpr, WAIT: tl.constexpr):
    """``acc [BM, BN, C]`` plus the K step at column ``k``: each chunk's dequantized products
    summed. With ``WAIT`` the weight tile (and, fp8, each chunk's scale) loads first, then
    ``gdc_wait``, then ``x``; without, ``x`` loads first."""
    in_k = cols < K - k                                                    # [1, 1, C, V]
    if not WAIT:
        x = tl.load(x_ptrs, mask=x_rows & in_k, other=0.0, eviction_policy="evict_last")
    w = tl.load(w_ptrs, mask=w_rows_on & in_k, other=0.0, eviction_policy="evict_first")
    if SCALE_BLOCK_K:  # fp8: each chunk lies in one scale block
        blocks = (k + chunks * VECTOR_C) // SCALE_BLOCK_K                  # [1, 1, C]
        chunk_scales = tl.load(scale_rows[None, :, None] + blocks,
                               mask=row_mask[None, :, None] & (chunks * VECTOR_C < K - k),
                               other=0.0)                                  # [1, BN, C]
    if WAIT:
        gdc_wait()  # the previous kernel is done: x is written, out no longer read
        x = tl.load(x_ptrs, mask=x_rows & in_k, other=0.0, eviction_policy="evict_last")
    if SCALE_BLOCK_K:
        acc += tl.sum(x.to(tl.float32) * w.to(tl.float32), axis=3) * chunk_scales
    else:
        acc += tl.sum(x.to(tl.float32) * int8_to_f32(w, FAST_INT8), axis=3)
    return acc


@triton.jit
def weight_row_dots(x_ptr, stride_xm, M, w_rows, row_mask, scale_rows, K,
                    SCALE_BLOCK_K: tl.constexpr, FAST_INT8: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    NUM_STAGES: tl.constexpr, PDL_ENTRY: tl.constexpr):
    """``[BLOCK_M, BLOCK_N]`` fp32 dot products over ``K`` columns of the first ``M`` rows of
    ``x`` (at ``x_ptr``, rows ``stride_xm`` apart; rows past ``M`` give 0) with the 8-bit
    weight rows at the pointers ``w_rows [BLOCK_N]`` (rows off in ``row_mask`` give 0), both
    with unit column stride, dequantized: ``SCALE_BLOCK_K == 0``, int8 rows times their scale
    at ``scale_rows [BLOCK_N]``; else fp8, each block of ``SCALE_BLOCK_K`` columns times its
    scale at ``scale_rows + k // SCALE_BLOCK_K``. With ``PDL_ENTRY`` (the GEMV's PDL entry,
    every thread passing): launch the dependents, issue the first step's weight and scale
    loads, then ``gdc_wait`` before loading ``x``; the loop runs the other steps."""
    CHUNKS: tl.constexpr = BLOCK_K // VECTOR_C
    chunks = tl.arange(0, CHUNKS)[None, None, :]                            # [1, 1, C]
    cols = chunks[:, :, :, None] * VECTOR_C + tl.arange(0, VECTOR_C)[None, None, None, :]
    offs_m = tl.arange(0, BLOCK_M)[:, None, None, None]                    # [BM, 1, 1, 1]
    x_ptrs = x_ptr + offs_m * stride_xm + cols                             # [BM, 1, C, V]
    w_ptrs = w_rows[None, :, None, None] + cols                            # [1, BN, C, V]
    x_rows = offs_m < M
    w_rows_on = row_mask[None, :, None, None]
    if PDL_ENTRY:
        gdc_launch_dependents()
    if not SCALE_BLOCK_K:  # int8: the rows' scales, loaded with the first weights
        row_scales = tl.load(scale_rows, mask=row_mask, other=0.0)        # [BN]
    acc = tl.zeros((BLOCK_M, BLOCK_N, CHUNKS), dtype=tl.float32)
    if PDL_ENTRY:  # the loop's first step, its weight loads issued before the wait
        acc = _k_step(acc, x_ptrs, x_rows, w_ptrs, w_rows_on, scale_rows, row_mask, chunks,
                      cols, 0, K, SCALE_BLOCK_K, FAST_INT8, True)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    for k in tl.range(BLOCK_K if PDL_ENTRY else 0, K, BLOCK_K, num_stages=NUM_STAGES):
        acc = _k_step(acc, x_ptrs, x_rows, w_ptrs, w_rows_on, scale_rows, row_mask, chunks,
                      cols, k, K, SCALE_BLOCK_K, FAST_INT8, False)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    out = tl.sum(acc, axis=2)                                              # [BM, BN]
    if not SCALE_BLOCK_K:  # int8: the row's scale, once per output
        out *= row_scales[None, :]
    return out


# N only bounds the rows, so a new N (divisible by 16 or not) needs no new compile.
@triton.jit(do_not_specialize=["N"])
def _gemv_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, M, N, K,
                 stride_xm, stride_wn, stride_sn, stride_om, scale_block_n,
                 SCALE_BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, FAST_INT8: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 NUM_STAGES: tl.constexpr, USE_PDL: tl.constexpr):
    """One program per ``BLOCK_N`` weight rows: ``weight_row_dots`` of all ``M`` rows of
    ``x``, plus the bias in fp32, rounded once to the output's dtype. int8: ``scale [N]``
    (``scale_block_n`` 1, ``stride_sn`` 1); fp8: ``scale [N / bn, K / bk]``. ``USE_PDL``:
    ``weight_row_dots``'s PDL entry."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)             # [BN]
    row_mask = rows < N
    out = weight_row_dots(x_ptr, stride_xm, M, w_ptr + rows.to(tl.int64) * stride_wn,
                          row_mask, scale_ptr + (rows // scale_block_n) * stride_sn, K,
                          SCALE_BLOCK_K, FAST_INT8, BLOCK_M, BLOCK_N, BLOCK_K,
                          NUM_STAGES, USE_PDL)                             # [BM, BN]
    if HAS_BIAS:
        out += tl.load(bias_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)[None, :]
    offs_m = tl.arange(0, BLOCK_M)
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + rows[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty),
             mask=(offs_m[:, None] < M) & row_mask[None, :])


def scale_block_k(block: tuple[int, int] | None) -> int:
    """The kernels' ``SCALE_BLOCK_K``: 0 for int8 (``block`` ``None``), else the fp8 scale
    block's columns, a multiple of ``VECTOR``."""
    if block is None:
        return 0
    if block[1] % VECTOR:
        raise ValueError(f"fp8 scale blocks of {block[1]} columns: a multiple of {VECTOR} "
                         f"needed")
    return block[1]


def gemv_8bit(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
              bias: torch.Tensor | None, block: tuple[int, int] | None = None,
              config: GemvConfig | None = None, fast_int8: bool | None = None
              ) -> torch.Tensor:
    """``x [M, K]`` (rows contiguous) @ dequantized ``weight [N, K]``^T (rows contiguous) +
    ``bias [N]`` -> ``[M, N]`` in ``x.dtype``, ``1 <= M <= GEMV_MAX_ROWS``. ``block`` ``None``:
    int8 with ``scale [N]``; else fp8 with ``scale [ceil(N/bn), ceil(K/bk)]`` (contiguous).
    ``config`` overrides ``gemv_configs.default_config``; ``fast_int8`` (default: on CUDA)
    picks the inline-PTX int8 conversion."""
    (m, k), n = x.shape, weight.shape[0]
    if not 1 <= m <= GEMV_MAX_ROWS:
        raise ValueError(f"gemv_8bit serves 1 to {GEMV_MAX_ROWS} rows, got {m}")
    config = config or default_config(m, n, k)
    out = x.new_empty(m, n)
    _gemv_kernel[(triton.cdiv(n, config.BLOCK_N),)](
        x, weight, scale, bias, out, m, n, k, x.stride(0), weight.stride(0),
        scale.stride(0) if block else 1, out.stride(0), block[0] if block else 1,
        SCALE_BLOCK_K=scale_block_k(block), HAS_BIAS=bias is not None,
        FAST_INT8=x.is_cuda if fast_int8 is None else fast_int8, BLOCK_M=block_m(m),
        BLOCK_N=config.BLOCK_N, BLOCK_K=config.BLOCK_K, NUM_STAGES=config.num_stages,
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl_arguments(x.device, m))
    return out
