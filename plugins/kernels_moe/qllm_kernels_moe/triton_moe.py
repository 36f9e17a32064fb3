"""Fused MoE on Triton: token slots sorted by expert, then two grouped GEMMs.

With ``x [T, H]``, ``w13 [E, 2I, H]`` (gate rows, then up rows), ``w2 [E, H, I]``, the shared
expert's ``[2I, H]`` and ``[H, I]`` weights as expert ``E``, and routing ``[T, k]`` (``S = T * k``
slots, slot ``t * k + j``; the model's last slot per token is the shared expert's):

1. ``moe_align`` lists the slots grouped by expert (``E + 1`` of them), in blocks of
   ``BLOCK_M`` of one expert (``triton_align``: one launch up to ``MAX_SLOTS`` slots, three
   beyond).
2. ``gate_up``: per block, the tokens' rows of ``x`` times the expert's gate and up rows (two
   accumulators over the same ``x`` tile; a block of expert ``E`` reads the shared expert's
   weights), epilogue ``silu(gate) * up`` -> ``hidden [S, I]``.
3. ``down``: per block, ``hidden``'s rows times the expert's ``w2``, epilogue times the slot's
   routing weight -> ``expert_out [S, H]``, returned as the per-slot outputs ``[T, k, H]``
   (a token's slots are adjacent rows). The sum over a token's slots is left to the residual
   add after the block (``add_rms_norm``), which reads them in fp32, in slot order: a
   deterministic sum, no atomic adds, and no kernel of its own.

Every launch size follows from the shapes (blocks past ``num_blocks`` exit at once), so the
whole op is free of host syncs and capturable in a CUDA graph. A table entry with ``BLOCK_M``
1 takes the small-batch path of ``triton_slot_moe`` instead: one program per slot, no sort.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qllm_kernels_moe.align import SortedSlots
from qllm_kernels_moe.configs import GemmConfig, MoeConfig, get_config
from qllm_kernels_moe.triton_align import moe_align_triton
from qllm_kernels_moe.triton_slot_moe import slot_down, slot_gate_up, slot_moe


@triton.jit
def grouped_tile(pid, num_m, num_n, GROUP_M: tl.constexpr):
    """The ``(row block, column block)`` of program ``pid`` in a grid of ``num_m x num_n``
    tiles, in grouped order: ``GROUP_M`` consecutive row blocks sweep the columns together, so
    that row blocks sharing a weight tile (those of one expert, or all rows of a GEMM) read it
    while it is in L2."""
    per_group = GROUP_M * num_n
    first_m = pid // per_group * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + pid % per_group % group_rows, pid % per_group // group_rows


@triton.jit
def _pointer_tiles(a_ptrs, a_mask, w_ptrs, N, K, stride_w_row, col_mask, GATED: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``_expert_gemm_kernel``'s accumulators ``[BM, BN]`` (gate or only, then up) over
    ``K``: ``a_ptrs [BM, BK]`` (rows masked by ``a_mask``) times the weight tiles at ``w_ptrs
    [BK, BN]`` (the gate or only rows, transposed; ``GATED``: the up rows ``N`` below)."""
    ks = tl.arange(0, BLOCK_K)
    up_ptrs = w_ptrs + N * stride_w_row  # GATED: the up rows, N below the gate rows
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        k_mask = ks < K - k_start
        a = tl.load(a_ptrs, mask=a_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & col_mask[None, :]
        acc = tl.dot(a, tl.load(w_ptrs, mask=w_mask, other=0.0), acc)
        if GATED:
            acc_up = tl.dot(a, tl.load(up_ptrs, mask=w_mask, other=0.0), acc_up)
            up_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    return acc, acc_up


@triton.jit(do_not_specialize=["num_slots"])
def _expert_gemm_kernel(
    a_ptr, w_ptr, shared_w_ptr, out_ptr, routing_weights_ptr,
    slots_ptr, block_experts_ptr, num_blocks_ptr,
    num_slots, num_experts, N, K,
    stride_a_row, stride_w_expert, stride_w_row, stride_out_row,
    SLOTS_PER_A_ROW: tl.constexpr, GATED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """``out[s, n] = sum_k a[s // SLOTS_PER_A_ROW, k] * w[e, n, k]`` for the slots ``s`` of one
    block of expert ``e``, and ``BLOCK_N`` columns ``n``; expert ``num_experts`` is
    ``shared_w`` (one expert's weights, same row stride). ``GATED`` (GEMM 1): ``w`` holds ``N``
    gate rows then ``N`` up rows, and ``out = silu(gate) * up``. Otherwise (GEMM 2) ``out`` is
    scaled by ``routing_weights[s]``. Rows of ``a``, ``w``, ``out`` have unit stride."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = grouped_tile(pid, tl.num_programs(0) // num_n, num_n, GROUP_M)
    if pid_m >= tl.load(num_blocks_ptr):
        return

    expert = tl.load(block_experts_ptr + pid_m)
    slots = tl.load(slots_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BM]
    slot_mask = slots < num_slots  # padding entries hold num_slots
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    col_mask = cols < N
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (slots // SLOTS_PER_A_ROW)[:, None] * stride_a_row + ks[None, :]  # [BM, BK]
    if expert == num_experts:
        expert_w_ptr = shared_w_ptr
    else:
        expert_w_ptr = w_ptr + expert * stride_w_expert
    w_ptrs = expert_w_ptr + cols[None, :] * stride_w_row + ks[:, None]  # [BK, BN]: w[e]^T
    acc, acc_up = _pointer_tiles(a_ptrs, slot_mask, w_ptrs, N, K, stride_w_row, col_mask,
                                 GATED, BLOCK_M, BLOCK_N, BLOCK_K)

    if GATED:
        acc = acc * tl.sigmoid(acc) * acc_up  # silu(gate) * up
    else:
        weights = tl.load(routing_weights_ptr + slots, mask=slot_mask, other=0.0)  # [BM]
        acc = acc * weights.to(tl.float32)[:, None]
    out_ptrs = out_ptr + slots[:, None] * stride_out_row + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty),
             mask=slot_mask[:, None] & col_mask[None, :])


def _launch(a: torch.Tensor, w: torch.Tensor, shared_w: torch.Tensor, out: torch.Tensor,
            routing_weights: torch.Tensor, sorted_slots: SortedSlots, block_m: int,
            config: GemmConfig, *, slots_per_a_row: int, gated: bool) -> torch.Tensor:
    n = out.shape[1]
    grid = (sorted_slots.block_experts.shape[0] * triton.cdiv(n, config.BLOCK_N),)
    _expert_gemm_kernel[grid](
        a, w, shared_w, out, routing_weights,
        sorted_slots.slots, sorted_slots.block_experts, sorted_slots.num_blocks,
        out.shape[0], w.shape[0], n, a.shape[1],
        a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        SLOTS_PER_A_ROW=slots_per_a_row, GATED=gated,
        BLOCK_M=block_m, BLOCK_N=config.BLOCK_N, BLOCK_K=config.BLOCK_K,
        GROUP_M=config.GROUP_M, num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out


def gate_up(x: torch.Tensor, w13: torch.Tensor, shared_w13: torch.Tensor,
            sorted_slots: SortedSlots, top_k: int, block_m: int,
            config: GemmConfig) -> torch.Tensor:
    """GEMM 1: ``x [T, H]`` through each slot's expert ``w13 [E, 2I, H]`` (expert ``E``:
    ``shared_w13 [2I, H]``) -> ``silu(gate) * up`` as ``hidden [S, I]`` (row = slot)."""
    hidden = x.new_empty(top_k * x.shape[0], w13.shape[1] // 2)
    # no routing weights in GEMM 1: ``hidden`` stands in for the unused pointer
    return _launch(x, w13, shared_w13, hidden, hidden, sorted_slots, block_m, config,
                   slots_per_a_row=top_k, gated=True)


def down(hidden: torch.Tensor, w2: torch.Tensor, shared_w2: torch.Tensor,
         topk_weights: torch.Tensor, sorted_slots: SortedSlots, block_m: int,
         config: GemmConfig) -> torch.Tensor:
    """GEMM 2: ``hidden [S, I]`` through each slot's expert ``w2 [E, H, I]`` (expert ``E``:
    ``shared_w2 [H, I]``), times the slot's routing weight (``topk_weights [T, k]``,
    contiguous) -> ``[S, H]``."""
    expert_out = hidden.new_empty(hidden.shape[0], w2.shape[1])
    return _launch(hidden, w2, shared_w2, expert_out, topk_weights, sorted_slots, block_m,
                   config, slots_per_a_row=1, gated=False)


def fused_moe_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                     topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                     shared_w13: torch.Tensor, shared_w2: torch.Tensor,
                     config: MoeConfig | None = None) -> torch.Tensor:
    """Routed SwiGLU experts, the same contract as the plain-torch ``fused_moe``: ``x [T, H]``,
    ``w13 [E, 2I, H]``, ``w2 [E, H, I]``, the shared expert (id ``E``) ``shared_w13 [2I, H]``
    and ``shared_w2 [H, I]``, ``topk_weights`` / ``topk_ids [T, k]`` -> each slot's expert
    output times its routing weight, ``[T, k, H]`` in ``x.dtype``. ``config`` defaults to the
    table entry for ``T``."""
    tokens, hidden_size = x.shape
    num_experts, gate_up_rows, _ = w13.shape
    top_k = topk_ids.shape[1]
    if (w13.shape[2] != hidden_size or w2.shape != (num_experts, hidden_size, gate_up_rows // 2)
            or shared_w13.shape != w13.shape[1:] or shared_w2.shape != w2.shape[1:]
            or any(w.stride()[-2:] != (w.shape[-1], 1) for w in (w13, w2, shared_w13, shared_w2))):
        raise ValueError(
            f"unsupported expert weights: w13 {tuple(w13.shape)} strides {w13.stride()}, w2 "
            f"{tuple(w2.shape)} strides {w2.stride()}, shared {tuple(shared_w13.shape)} and "
            f"{tuple(shared_w2.shape)} for x {tuple(x.shape)}; expected [E, 2I, H] and "
            "[E, H, I] with contiguous rows, and one expert's [2I, H] and [H, I]")
    if tokens == 0:
        return x.new_zeros(tokens, top_k, hidden_size)
    if config is None:
        config = get_config(tokens, num_experts, gate_up_rows, hidden_size, top_k)
    x = x if x.stride(-1) == 1 else x.contiguous()
    topk_weights, topk_ids = topk_weights.contiguous(), topk_ids.contiguous()
    if config.BLOCK_M == 1:
        if config.persistent_programs_per_sm:
            expert_out = slot_moe(x, w13, w2, shared_w13, shared_w2, topk_weights, topk_ids,
                                  config)
        else:
            prefetch = (w2, shared_w2) if config.prefetch_down and x.is_cuda else None
            hidden = slot_gate_up(x, w13, shared_w13, topk_ids, config.up, prefetch)  # [S, I]
            expert_out = slot_down(hidden, w2, shared_w2, topk_weights, topk_ids, config.down)
        return expert_out.view(tokens, top_k, hidden_size)
    sorted_slots = moe_align_triton(topk_ids, num_experts + 1, config.BLOCK_M)
    hidden = gate_up(x, w13, shared_w13, sorted_slots, top_k, config.BLOCK_M,
                     config.up)  # [S, I]
    expert_out = down(hidden, w2, shared_w2, topk_weights, sorted_slots,
                      config.BLOCK_M, config.down)  # [S, H]
    return expert_out.view(tokens, top_k, hidden_size)
