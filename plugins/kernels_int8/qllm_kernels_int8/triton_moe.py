"""Fused MoE on 8-bit expert weights: qllm-kernels-moe's sort by expert (``moe_align_triton``,
its tile table ``get_config``), then two grouped GEMMs that read 8-bit weight tiles.

The structure is kernels_moe's ``triton_moe`` (see there: slots ``t * k + j``, the shared
expert as expert ``E``, blocks of ``BLOCK_M`` slots of one expert, per-slot outputs ``[T, k,
H]`` left for the residual add to sum); what differs is the weight tiles:

- int8 (W8A16): each int8 tile converted to the activations' dtype (exact) before
  ``tl.dot``; the rows' scales multiply the accumulators in the epilogue (gate and up rows
  each their own).
- fp8 (W8A8): ``x`` (GEMM 1) and ``hidden`` (GEMM 2) quantized to e4m3 per token and group
  of ``bk`` columns first (``triton_linear.fp8_group_quant``); each ``BLOCK_K`` step lies in
  one group and adds ``dot(a, w) * a_scale[row] * w_scale[n // bn]``.

Where the table's entry has ``BLOCK_M == 1`` (kernels_moe's one-program-per-slot path, at a
few tokens), the 8-bit twin of that path runs instead (``triton_slot_moe``: no sort, GEMV-style
programs, fp8 weight-only there), with its own tiles (``gemv_configs.slot_moe_config``). The
sorted path's tiles: each format has its own table (``configs/int8/``, ``configs/fp8/``: the
tile sweeps of ``bench_int8.py --sweep [--format fp8]``); a shape without one takes kernels_moe's
bf16 table.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import triton
import triton.language as tl

from qllm_kernels_moe.configs import CONFIG_DIR, GemmConfig, MoeConfig, config_path, get_config
from qllm_kernels_moe.triton_align import moe_align_triton
from qllm_kernels_moe.triton_moe import grouped_tile

from qllm_kernels_int8.gemv_configs import slot_moe_config
from qllm_kernels_int8.triton_linear import fp8_group_quant
from qllm_kernels_int8.triton_slot_moe import slot_down_8bit, slot_gate_up_8bit

MIN_FP8_BLOCK_K = 32
TABLE_DIRS = {fmt: Path(__file__).parent / "configs" / fmt for fmt in ("int8", "fp8")}


@triton.jit(do_not_specialize=["num_slots"])
def _expert_gemm_8bit_kernel(
    a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, shared_w_ptr, shared_scale_ptr, out_ptr,
    routing_weights_ptr, slots_ptr, block_experts_ptr, num_blocks_ptr,
    num_slots, num_experts, N, K,
    stride_a_row, stride_as_row, stride_w_expert, stride_w_row, stride_s_expert, stride_s_row,
    stride_out_row, scale_block_n,
    SLOTS_PER_A_ROW: tl.constexpr, GATED: tl.constexpr, FP8: tl.constexpr,
    GROUP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """kernels_moe's ``_expert_gemm_kernel`` on 8-bit ``w``: int8 with per-row scales
    (``w_scale [E, rows]``, ``scale_block_n`` 1), or ``FP8`` e4m3 with block scales
    (``w_scale [E, rows / bn, K / GROUP_K]``) and e4m3 ``a`` with ``a_scale [rows of a,
    K / GROUP_K]``. Expert ``num_experts`` reads ``shared_w`` / ``shared_scale``."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = grouped_tile(pid, tl.num_programs(0) // num_n, num_n, GROUP_M)
    if pid_m >= tl.load(num_blocks_ptr):
        return

    expert = tl.load(block_experts_ptr + pid_m)
    slots = tl.load(slots_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BM]
    slot_mask = slots < num_slots
    a_rows = slots // SLOTS_PER_A_ROW
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    col_mask = cols < N
    ks = tl.arange(0, BLOCK_K)
    if expert == num_experts:
        expert_w_ptr = shared_w_ptr
        expert_s_ptr = shared_scale_ptr
    else:
        expert_w_ptr = w_ptr + expert * stride_w_expert
        expert_s_ptr = w_scale_ptr + expert * stride_s_expert
    a_ptrs = a_ptr + a_rows[:, None] * stride_a_row + ks[None, :]  # [BM, BK]
    w_ptrs = expert_w_ptr + cols[None, :] * stride_w_row + ks[:, None]  # [BK, BN]: w[e]^T
    up_ptrs = w_ptrs + N * stride_w_row  # GATED: the up rows, N below the gate rows
    gate_s_ptrs = expert_s_ptr + (cols // scale_block_n) * stride_s_row  # [BN]
    up_s_ptrs = expert_s_ptr + ((N + cols) // scale_block_n) * stride_s_row
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        k_mask = ks < K - k_start
        a = tl.load(a_ptrs, mask=slot_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & col_mask[None, :]
        w = tl.load(w_ptrs, mask=w_mask, other=0.0)
        if FP8:
            group = k_start // GROUP_K
            a_s = tl.load(a_scale_ptr + a_rows * stride_as_row + group, mask=slot_mask,
                          other=0.0)[:, None]  # [BM, 1]
            w_s = tl.load(gate_s_ptrs + group, mask=col_mask, other=0.0)[None, :]
            acc += tl.dot(a, w) * a_s * w_s
            if GATED:
                up = tl.load(up_ptrs, mask=w_mask, other=0.0)
                up_s = tl.load(up_s_ptrs + group, mask=col_mask, other=0.0)[None, :]
                acc_up += tl.dot(a, up) * a_s * up_s
        else:
            acc = tl.dot(a, w.to(a.dtype), acc)
            if GATED:
                up = tl.load(up_ptrs, mask=w_mask, other=0.0)
                acc_up = tl.dot(a, up.to(a.dtype), acc_up)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
    if not FP8:  # int8: each output row's scale
        acc *= tl.load(gate_s_ptrs, mask=col_mask, other=0.0)[None, :]
        if GATED:
            acc_up *= tl.load(up_s_ptrs, mask=col_mask, other=0.0)[None, :]
    if GATED:
        acc = acc * tl.sigmoid(acc) * acc_up  # silu(gate) * up
    else:
        weights = tl.load(routing_weights_ptr + slots, mask=slot_mask, other=0.0)
        acc = acc * weights.to(tl.float32)[:, None]
    out_ptrs = out_ptr + slots[:, None] * stride_out_row + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty),
             mask=slot_mask[:, None] & col_mask[None, :])


def expert_gemm_args(a, a_scale, w, w_scale, shared_w, shared_scale, out, routing_weights,
                     sorted_slots, block_m: int, config: GemmConfig, *, slots_per_a_row: int,
                     gated: bool, block: tuple[int, int] | None) -> dict:
    """``_expert_gemm_8bit_kernel``'s arguments by name (not the launch options), writing
    ``out [S, N]`` from ``a`` (int8: ``block`` ``None``, ``a_scale`` unused; fp8: ``block``
    the weights' scale block) on ``sorted_slots`` at ``block_m`` slots per block."""
    fp8 = block is not None
    return dict(
        a_ptr=a, a_scale_ptr=a_scale, w_ptr=w, w_scale_ptr=w_scale, shared_w_ptr=shared_w,
        shared_scale_ptr=shared_scale, out_ptr=out, routing_weights_ptr=routing_weights,
        slots_ptr=sorted_slots.slots, block_experts_ptr=sorted_slots.block_experts,
        num_blocks_ptr=sorted_slots.num_blocks, num_slots=out.shape[0],
        num_experts=w.shape[0], N=out.shape[1], K=a.shape[1], stride_a_row=a.stride(0),
        stride_as_row=a_scale.stride(0) if fp8 else 0, stride_w_expert=w.stride(0),
        stride_w_row=w.stride(1), stride_s_expert=w_scale.stride(0),
        stride_s_row=w_scale.stride(1) if fp8 else 1, stride_out_row=out.stride(0),
        scale_block_n=block[0] if fp8 else 1, SLOTS_PER_A_ROW=slots_per_a_row, GATED=gated,
        FP8=fp8, GROUP_K=block[1] if fp8 else 1, BLOCK_M=block_m, BLOCK_N=config.BLOCK_N,
        BLOCK_K=config.BLOCK_K, GROUP_M=config.GROUP_M)


def _launch(a, a_scale, w, w_scale, shared_w, shared_scale, out, routing_weights,
            sorted_slots, block_m: int, config: GemmConfig, *, slots_per_a_row: int,
            gated: bool, block: tuple[int, int] | None) -> torch.Tensor:
    """One grouped GEMM (``expert_gemm_args``) over every block the sort may fill."""
    grid = (sorted_slots.block_experts.shape[0] * triton.cdiv(out.shape[1], config.BLOCK_N),)
    _expert_gemm_8bit_kernel[grid](
        **expert_gemm_args(a, a_scale, w, w_scale, shared_w, shared_scale, out,
                           routing_weights, sorted_slots, block_m, config,
                           slots_per_a_row=slots_per_a_row, gated=gated, block=block),
        num_warps=config.num_warps, num_stages=config.num_stages)
    return out


def _fit(config: GemmConfig, block: tuple[int, int] | None) -> GemmConfig:
    """fp8: ``BLOCK_K`` within the scale block's columns (both powers of two), and at least
    32 (the fp8 ``tl.dot``'s smallest K)."""
    if block is None:
        return config
    if block[1] < MIN_FP8_BLOCK_K:
        raise ValueError(f"fp8 scale blocks of {block[1]} columns: at least "
                         f"{MIN_FP8_BLOCK_K} needed")
    block_k = min(max(config.BLOCK_K, MIN_FP8_BLOCK_K), block[1])
    return config if block_k == config.BLOCK_K else dataclasses.replace(config,
                                                                        BLOCK_K=block_k)


def moe_config(tokens: int, num_experts: int, gate_up_rows: int, hidden_size: int,
               top_k: int, block: tuple[int, int] | None = None) -> MoeConfig:
    """The table entry for ``tokens`` (int8 with ``block`` ``None``, else fp8: this plugin's
    table of that format where the shape has one, else kernels_moe's bf16 table); where it
    picks the slot path (``BLOCK_M`` 1), the 8-bit slot path's tiles (``slot_moe_config``)."""
    table_dir = TABLE_DIRS["int8" if block is None else "fp8"]
    if not config_path(num_experts, gate_up_rows, hidden_size, table_dir).is_file():
        table_dir = CONFIG_DIR
    config = get_config(tokens, num_experts, gate_up_rows, hidden_size, top_k, table_dir)
    if config.BLOCK_M == 1:
        return slot_moe_config(tokens * top_k, gate_up_rows // 2, hidden_size)
    return config


def fused_moe_8bit(x: torch.Tensor, w13: tuple[torch.Tensor, torch.Tensor],
                   w2: tuple[torch.Tensor, torch.Tensor], topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor, shared_w13: tuple[torch.Tensor, torch.Tensor],
                   shared_w2: tuple[torch.Tensor, torch.Tensor],
                   block: tuple[int, int] | None = None,
                   config: MoeConfig | None = None, quantize=fp8_group_quant) -> torch.Tensor:
    """The ``fused_moe_w8a16`` (``block`` ``None``) / ``fused_moe_fp8_block`` contract:
    ``x [T, H]``, ``(weight, scale)`` pairs of the experts' ``w13 [E, 2I, H]`` and ``w2 [E,
    H, I]`` and of the shared expert's ``[2I, H]`` / ``[H, I]``, routing ``[T, k]`` -> each
    slot's weighted output ``[T, k, H]`` in ``x.dtype``. Weights and scales contiguous.
    ``config`` defaults to ``moe_config``'s; one with ``BLOCK_M`` 1 runs the slot path (fp8
    weight-only). ``quantize(a, group) -> (q, scale)`` quantizes the sorted fp8 path's
    activations (the Triton kernel; tests pass the plain-torch one, see
    ``test_kernels_int8``)."""
    (w13_q, w13_s), (w2_q, w2_s) = w13, w2
    tokens, hidden_size = x.shape
    num_experts, gate_up_rows, _ = w13_q.shape
    top_k = topk_ids.shape[1]
    if tokens == 0:
        return x.new_zeros(tokens, top_k, hidden_size)
    config = config or moe_config(tokens, num_experts, gate_up_rows, hidden_size, top_k, block)
    x = x if x.stride(-1) == 1 else x.contiguous()
    topk_weights, topk_ids = topk_weights.contiguous(), topk_ids.contiguous()
    if config.BLOCK_M == 1:
        hidden = slot_gate_up_8bit(x, w13, shared_w13, topk_ids, config.up, block)  # [S, I]
        expert_out = slot_down_8bit(hidden, w2, shared_w2, topk_weights, topk_ids,
                                    config.down, block)  # [S, H]
        return expert_out.view(tokens, top_k, hidden_size)
    sorted_slots = moe_align_triton(topk_ids, num_experts + 1, config.BLOCK_M)
    if block is None:
        a, a_scale = x, x  # no activation scales: ``x`` stands in for the unused pointer
    else:
        a, a_scale = quantize(x, block[1])
    hidden = x.new_empty(tokens * top_k, gate_up_rows // 2)  # [S, I]
    _launch(a, a_scale, w13_q, w13_s, *shared_w13, hidden, hidden, sorted_slots,
            config.BLOCK_M, _fit(config.up, block), slots_per_a_row=top_k, gated=True,
            block=block)
    if block is None:
        h, h_scale = hidden, hidden
    else:
        h, h_scale = quantize(hidden, block[1])
    expert_out = x.new_empty(tokens * top_k, hidden_size)  # [S, H]
    _launch(h, h_scale, w2_q, w2_s, *shared_w2, expert_out, topk_weights, sorted_slots,
            config.BLOCK_M, _fit(config.down, block), slots_per_a_row=1, gated=False,
            block=block)
    return expert_out.view(tokens, top_k, hidden_size)
