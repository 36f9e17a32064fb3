"""The MoE on 8-bit experts for a handful of tokens: kernels_moe's one-program-per-slot path
(``qllm_kernels_moe.triton_slot_moe``: no sort, each program streams long contiguous weight rows
of its slot's expert), with the 8-bit GEMV's core (``triton_gemv.weight_row_dots``): int8 rows
times their scale once per output, or fp8 blocks times their scales (weight-only, as the dense
GEMV: activations are not quantized).

With ``x [T, H]``, ``topk_ids [T, k]`` (``S = T * k`` slots, slot ``t * k + j``; expert ``E``
reads the shared expert's weights and scales):

1. ``slot_gate_up_8bit``: one program per (slot, ``BLOCK_N`` intermediate columns) reads its
   token's row of ``x`` and, interleaved, the gate and up row of each column (``2 * BLOCK_N``
   rows in one pass over K), and stores ``silu(gate) * up`` -> ``hidden [S, I]``.
2. ``slot_down_8bit``: one program per (slot, ``BLOCK_N`` output columns): ``hidden``'s row
   through the slot's ``w2`` rows, times the routing weight, rounded to ``x.dtype`` ->
   ``expert_out [S, H]``, the per-slot outputs the residual add after the block sums.

An expert hit by several slots is read once per slot (from L2 after the first): the path pays
while slots rarely share experts, at the token counts where kernels_moe's table chooses its own
slot path (``BLOCK_M == 1``). Launch parameters: ``gemv_configs.slot_moe_config``. No host
syncs: capturable in a CUDA graph. In small decode steps (``qllm.plugins.pdl``) both kernels are
launched with programmatic dependent launch, as in kernels_moe's slot path: the gate-up waits
for the router at entry (the expert ids are its output) and only then lets the down launch, so
the router has completed when the down starts; the down reads its ids and its first weight
step before its own wait (``weight_row_dots``' PDL entry).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qllm.plugins.pdl import pdl_arguments, pdl_release, pdl_wait
from qllm_kernels_moe.configs import GemmConfig

from qllm_kernels_int8.triton_gemv import scale_block_k, weight_row_dots


@triton.jit
def _expert_rows(ids_ptr, w_ptr, shared_w_ptr, scale_ptr, shared_scale_ptr, num_experts,
                 rows, stride_w_expert, stride_w_row, stride_s_expert, stride_s_row,
                 scale_block_n):
    """This program's slot's expert (``num_experts``: the shared expert's tensors): pointers
    to its weight rows ``rows [R]`` and to each row's scales (int8: ``scale_block_n`` 1, one
    scale per row; fp8: the row's block of ``scale_block_n`` rows). The id is read past the L1
    cache: the down reads it before its PDL wait (module docstring)."""
    expert = tl.load(ids_ptr + tl.program_id(0), cache_modifier=".cg")
    shared = expert == num_experts
    w_base = tl.where(shared, shared_w_ptr, w_ptr + expert * stride_w_expert)
    s_base = tl.where(shared, shared_scale_ptr, scale_ptr + expert * stride_s_expert)
    return w_base + rows * stride_w_row, s_base + (rows // scale_block_n) * stride_s_row


@triton.jit
def _slot_gate_up_kernel(x_ptr, w_ptr, shared_w_ptr, scale_ptr, shared_scale_ptr, ids_ptr,
                         hidden_ptr, num_experts, N, K, stride_x_row, stride_w_expert,
                         stride_w_row, stride_s_expert, stride_s_row, scale_block_n,
                         TOP_K: tl.constexpr, SCALE_BLOCK_K: tl.constexpr,
                         FAST_INT8: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
                         USE_PDL: tl.constexpr):
    """``hidden[s, n] = silu(x[t] . w[e, n]) * (x[t] . w[e, N + n])`` (dequantized ``w``) for
    slot ``s`` of token ``t = s // TOP_K`` routed to expert ``e``."""
    pdl_wait(USE_PDL)  # the ids are the router's output, x the norm's
    pdl_release(USE_PDL)  # after the wait: the down reads the ids before its own
    ROWS: tl.constexpr = 2 * BLOCK_N
    slot = tl.program_id(0)
    pairs = tl.arange(0, ROWS)                                   # [2BN]: gate, up, gate, ...
    cols = tl.program_id(1) * BLOCK_N + pairs // 2               # [2BN]
    w_rows, scale_rows = _expert_rows(
        ids_ptr, w_ptr, shared_w_ptr, scale_ptr, shared_scale_ptr, num_experts,
        cols + (pairs % 2) * N, stride_w_expert, stride_w_row, stride_s_expert, stride_s_row,
        scale_block_n)
    dots = weight_row_dots(x_ptr + (slot // TOP_K) * stride_x_row, 0, 1, w_rows, cols < N,
                           scale_rows, K, SCALE_BLOCK_K, FAST_INT8, 1, ROWS, BLOCK_K,
                           NUM_STAGES, False)                    # [1, 2BN]
    gate, up = tl.split(tl.reshape(dots, (BLOCK_N, 2)))          # [BN] each
    out = gate * tl.sigmoid(gate) * up
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(hidden_ptr + slot * N + n, out.to(hidden_ptr.dtype.element_ty), mask=n < N)


@triton.jit
def _slot_down_kernel(hidden_ptr, w_ptr, shared_w_ptr, scale_ptr, shared_scale_ptr, ids_ptr,
                      routing_weights_ptr, out_ptr, num_experts, N, K, stride_w_expert,
                      stride_w_row, stride_s_expert, stride_s_row, scale_block_n,
                      SCALE_BLOCK_K: tl.constexpr, FAST_INT8: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      NUM_STAGES: tl.constexpr, USE_PDL: tl.constexpr):
    """``out[s, n] = round(routing_weights[s] * (hidden[s] . w[e, n]))`` (dequantized ``w``)
    for slot ``s`` routed to expert ``e``; ``round`` to ``out``'s dtype."""
    slot = tl.program_id(0)  # the ids, read before the wait: the router has completed
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)      # [BN]
    w_rows, scale_rows = _expert_rows(
        ids_ptr, w_ptr, shared_w_ptr, scale_ptr, shared_scale_ptr, num_experts, n,
        stride_w_expert, stride_w_row, stride_s_expert, stride_s_row, scale_block_n)
    dots = weight_row_dots(hidden_ptr + slot * K, 0, 1, w_rows, n < N, scale_rows, K,
                           SCALE_BLOCK_K, FAST_INT8, 1, BLOCK_N, BLOCK_K,
                           NUM_STAGES, USE_PDL)                  # [1, BN]; hidden: the gate-up's
    out = tl.sum(dots, axis=0) * tl.load(routing_weights_ptr + slot).to(tl.float32)
    tl.store(out_ptr + slot * N + n, out.to(out_ptr.dtype.element_ty), mask=n < N)


def _weight_args(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None
                 ) -> tuple[int, ...]:
    """The kernels' ``stride_w_expert, stride_w_row, stride_s_expert, stride_s_row,
    scale_block_n`` for 8-bit experts ``w [E, R, C]`` with ``scale`` (int8: ``[E, R]``; fp8:
    ``[E, R / bn, C / bk]``); the shared expert's tensors have the same strides less ``E``."""
    if block is None:
        return w.stride(0), w.stride(1), scale.stride(0), 1, 1
    return w.stride(0), w.stride(1), scale.stride(0), scale.stride(1), block[0]


def _options(config: GemmConfig, block: tuple[int, int] | None, fast_int8: bool | None,
             a: torch.Tensor, tokens: int) -> dict:
    """The kernels' constexprs and launch options (``fast_int8`` default: on CUDA; PDL:
    ``pdl_arguments`` for ``tokens`` tokens)."""
    return dict(SCALE_BLOCK_K=scale_block_k(block),
                FAST_INT8=a.is_cuda if fast_int8 is None else fast_int8,
                BLOCK_N=config.BLOCK_N, BLOCK_K=config.BLOCK_K, NUM_STAGES=config.num_stages,
                num_warps=config.num_warps, num_stages=config.num_stages,
                **pdl_arguments(a.device, tokens))


def slot_gate_up_8bit(x: torch.Tensor, w13: tuple[torch.Tensor, torch.Tensor],
                      shared_w13: tuple[torch.Tensor, torch.Tensor], topk_ids: torch.Tensor,
                      config: GemmConfig, block: tuple[int, int] | None = None,
                      fast_int8: bool | None = None) -> torch.Tensor:
    """GEMM 1 per slot: ``x [T, H]`` (rows contiguous) through each slot's expert of the
    ``(weight, scale)`` pair ``w13`` (``[E, 2I, H]``; expert ``E``: ``shared_w13``'s ``[2I,
    H]``), ``topk_ids [T, k]`` contiguous -> ``silu(gate) * up`` as ``hidden [T * k, I]``.
    ``block`` ``None``: int8; else fp8 with that scale block."""
    (w, scale), (shared_w, shared_scale) = w13, shared_w13
    tokens, top_k = topk_ids.shape
    inter = w.shape[1] // 2
    hidden = x.new_empty(tokens * top_k, inter)
    grid = (tokens * top_k, triton.cdiv(inter, config.BLOCK_N))
    _slot_gate_up_kernel[grid](
        x, w, shared_w, scale, shared_scale, topk_ids, hidden, w.shape[0], inter, x.shape[1],
        x.stride(0), *_weight_args(w, scale, block), TOP_K=top_k,
        **_options(config, block, fast_int8, x, tokens))
    return hidden


def slot_down_8bit(hidden: torch.Tensor, w2: tuple[torch.Tensor, torch.Tensor],
                   shared_w2: tuple[torch.Tensor, torch.Tensor], topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor, config: GemmConfig,
                   block: tuple[int, int] | None = None, fast_int8: bool | None = None
                   ) -> torch.Tensor:
    """GEMM 2 per slot: ``hidden [T * k, I]`` (contiguous) through each slot's expert of the
    ``(weight, scale)`` pair ``w2`` (``[E, H, I]``; expert ``E``: ``shared_w2``'s ``[H, I]``),
    times ``topk_weights [T, k]`` (contiguous) -> ``expert_out [T * k, H]`` in
    ``hidden.dtype``, a token's slots adjacent."""
    (w, scale), (shared_w, shared_scale) = w2, shared_w2
    num_slots, inter = hidden.shape
    hidden_size = w.shape[1]
    out = hidden.new_empty(num_slots, hidden_size)
    grid = (num_slots, triton.cdiv(hidden_size, config.BLOCK_N))
    _slot_down_kernel[grid](
        hidden, w, shared_w, scale, shared_scale, topk_ids, topk_weights, out, w.shape[0],
        hidden_size, inter, *_weight_args(w, scale, block),
        **_options(config, block, fast_int8, hidden, topk_ids.shape[0]))
    return out
