"""The swap-AB W8A16 GEMM: ``out [M, N] = x [M, K] @ (w [N, K] int8 * scale [N])^T (+ bias)``
for ``M`` of 5 to 512 rows, computed as ``out^T = w @ x^T``.

Why swapped. On Hopper, ``wgmma`` reads its B operand from shared memory only, its A operand
from registers too. With the weights as B (``triton_linear.w8a16_gemm``), each converted int8
tile has to go back to shared memory before the MMA: a store, a fence and a barrier per loop
step (compiled for sm_90: ``STS`` of the converted tile, then ``HGMMA ... gdesc``, then a wait
for zero MMAs in flight). As A, the int8 tile goes from shared memory (``cp.async``,
pipelined) to registers, is converted there and feeds the MMA directly (``HGMMA ... R,
gdesc``). The weight rows are then the MMA's M (64 per warpgroup) and the input rows its N (up
to 256), so a program holds all of ``M`` up to 256 rows: each weight byte is loaded and
converted once.

The MMA is synchronous: each step's ``wgmma`` group is waited for (``WARPGROUP.DEPBAR.LE
gsb0, 0x0``) before the next step converts its tile into registers, so the MMA overlaps the
``cp.async`` loads in flight and the other warpgroups' and programs' work, not its own
warpgroup's next conversion. Triton's pipeliner would leave MMAs in flight there (3.6: the dot
split into 16-column ``wgmma`` groups, 3 of them left in flight at 64-column steps, 7 at
128-256; 3.7: two groups, one left in flight), counting on their A registers to stay
untouched until they retire; the ptxas that both bundle (12.8) does not keep them reserved
that long, and the next step's conversion wrote into the A registers of the MMAs still in
flight (``testing.in_flight_a_writes``): wrong results on an H200 under 3.6, the same pattern
in 3.7.1's code. ``_retire_mma`` makes the pipeliner wait for each MMA, at no instruction.

Conversion: ``int8_convert.int8_to_half``, exact, in the registers of the MMA's A operand: per
two weights (one 16-bit shared-memory load) a byte permute, two masks and a packed subtraction
(no ``I2F``); Triton's own cast (the interpreter's path) compiles to the same arithmetic with
4.5 permutes instead of one. The per-channel scale multiplies the fp32 accumulator once, in the
epilogue.

Split-K (``SPLIT_K > 1``): program ``(m, n, s)`` sums its share of the K steps into fp32
partial sums ``[SPLIT_K, M, N]``, scaled; a second launch adds them and the bias and rounds
once to the output dtype.

Launch parameters: ``gemm_configs`` (``swap_ab_config``). The launch depends on shapes only
(no host sync), so it runs inside CUDA graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qllm.plugins.devices import multiprocessors
from qllm_kernels_int8.gemm_configs import H200_SMS, W8A16GemmConfig, swap_ab_config
from qllm_kernels_int8.int8_convert import int8_to_half

SUM_BLOCK_N = 1024  # output columns per program of the split-K sum


@triton.jit
def _retire_mma(acc):
    """``acc`` as it is, through an empty inline asm (no instruction): a use of the MMA's
    result inside the K loop, which makes Triton's pipeliner wait for the MMA right after it
    (``wgmma.wait_group 0``) instead of leaving it in flight over the next step's conversion
    into its A registers (see the module docstring). Not for the interpreter (no asm)."""
    return tl.inline_asm_elementwise("", "=f,0", [acc], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _swap_ab_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, M, N, K, stride_xm,
                    stride_wn, stride_om, stride_split, k_per_split, HAS_BIAS: tl.constexpr,
                    FAST_INT8: tl.constexpr, SYNC_MMA: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program ``(m, n, s)``: output rows ``m * BLOCK_M ...`` and columns ``n * BLOCK_N ...``
    over K columns ``[s * k_per_split, (s + 1) * k_per_split)`` (``k_per_split`` a multiple
    of ``BLOCK_K``), scaled, written at ``out_ptr + s * stride_split`` in ``out``'s dtype
    (fp32 partial sums when split). Rows past ``M`` / ``N`` load row ``M - 1`` / ``N - 1``
    (no masks in the loop) and are not stored. ``SYNC_MMA`` (compiled for a GPU): each step's
    MMA retired before the next step converts (``_retire_mma``)."""
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows_w = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                      # [BN] weight rows
    rows_x = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)                      # [BM] input rows
    ks = tl.arange(0, BLOCK_K)                                            # [BK]
    k_start = pid_k * k_per_split
    w_ptrs = (w_ptr + tl.minimum(rows_w, N - 1)[:, None].to(tl.int64) * stride_wn
              + (k_start + ks)[None, :])                                  # [BN, BK]
    x_ptrs = (x_ptr + tl.minimum(rows_x, M - 1)[None, :] * stride_xm
              + (k_start + ks)[:, None])                                  # [BK, BM]: x^T
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)                  # out^T tile
    for k in range(k_start, tl.minimum(K, k_start + k_per_split), BLOCK_K):
        in_k = ks < K - k
        w = tl.load(w_ptrs, mask=in_k[None, :], other=0)                  # int8
        x = tl.load(x_ptrs, mask=in_k[:, None], other=0.0)
        acc = tl.dot(int8_to_half(w, x.dtype, FAST_INT8), x, acc)
        if SYNC_MMA:
            acc = _retire_mma(acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    w_on, x_on = rows_w < N, rows_x < M
    acc *= tl.load(scale_ptr + rows_w, mask=w_on, other=0.0)[:, None]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows_w, mask=w_on, other=0.0).to(tl.float32)[:, None]
    out_ptrs = out_ptr + pid_k * stride_split + rows_x[None, :] * stride_om + rows_w[:, None]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=w_on[:, None] & x_on[None, :])


@triton.jit
def _sum_splits_kernel(part_ptr, bias_ptr, out_ptr, M, N, stride_om, SPLIT_K: tl.constexpr,
                       HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program ``(m, n)``: row ``m``, columns ``n * BLOCK_N ...`` of ``out``: the sum of the
    ``SPLIT_K`` partial sums ``[SPLIT_K, M, N]`` plus the bias, rounded once."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)             # [BLOCK_N]
    on = cols < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for split in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + (split * M + row) * N + cols, mask=on, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=on, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=on)


def swap_ab_args(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                 bias: torch.Tensor | None, target: torch.Tensor, config: W8A16GemmConfig,
                 fast_int8: bool) -> dict:
    """``_swap_ab_kernel``'s arguments by name, writing ``target``: the output ``[M, N]``
    (``SPLIT_K`` 1, the bias added) or the fp32 partial sums ``[SPLIT_K, M, N]``."""
    (m, k), n = x.shape, weight.shape[0]
    steps = triton.cdiv(k, config.BLOCK_K)
    return dict(x_ptr=x, w_ptr=weight, scale_ptr=scale, bias_ptr=bias, out_ptr=target, M=m, N=n,
                K=k, stride_xm=x.stride(0), stride_wn=weight.stride(0),
                stride_om=target.stride(-2), stride_split=m * n,
                k_per_split=triton.cdiv(steps, config.SPLIT_K) * config.BLOCK_K,
                HAS_BIAS=bias is not None and config.SPLIT_K == 1, FAST_INT8=fast_int8,
                SYNC_MMA=x.device.type != "cpu",  # CUDA, or the meta tensors of testing.py
                BLOCK_N=config.BLOCK_N, BLOCK_M=config.BLOCK_M, BLOCK_K=config.BLOCK_K)


def w8a16_gemm_swap_ab(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                       bias: torch.Tensor | None, config: W8A16GemmConfig | None = None,
                       fast_int8: bool | None = None) -> torch.Tensor:
    """``x [M, K]`` (rows contiguous) @ ``(weight [N, K] int8 * scale [N])``^T + ``bias [N]``
    -> ``[M, N]`` in ``x.dtype``. ``config`` overrides ``gemm_configs.swap_ab_config``;
    ``fast_int8`` (default: on CUDA) picks the inline-PTX int8 conversion over Triton's cast."""
    (m, k), n = x.shape, weight.shape[0]
    config = config or swap_ab_config(m, n, k, multiprocessors(x.device, elsewhere=H200_SMS))
    split = config.SPLIT_K
    out = x.new_empty(m, n)
    target = out if split == 1 else torch.empty(split, m, n, dtype=torch.float32,
                                                device=x.device)  # [S, M, N] partial sums
    grid = (triton.cdiv(m, config.BLOCK_M), triton.cdiv(n, config.BLOCK_N), split)
    _swap_ab_kernel[grid](
        **swap_ab_args(x, weight, scale, bias, target, config,
                       x.is_cuda if fast_int8 is None else fast_int8),
        num_warps=config.num_warps, num_stages=config.num_stages)
    if split > 1:
        _sum_splits_kernel[(m, triton.cdiv(n, SUM_BLOCK_N))](
            target, bias, out, m, n, out.stride(0), SPLIT_K=split, HAS_BIAS=bias is not None,
            BLOCK_N=SUM_BLOCK_N)
    return out
