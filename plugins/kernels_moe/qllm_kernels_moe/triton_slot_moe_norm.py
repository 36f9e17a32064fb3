"""The slot path's down with the residual add and the RMSNorm after the MoE in the same kernel
(the ``fused_moe_add_rms_norm`` op at a few tokens).

In W3's one-token step the add + norm after the MoE (``add_rms_norm`` over the nine slot
outputs and the residual) is a kernel of its own, ending 3.8 us after the down on an H100
(2026-12-06), for ~40 KB of reads: the cost is the two kernel boundaries, not the work. Here,
with ``x [T, H]``'s slots ``S = T * k`` (``triton_slot_moe``'s layout, ``hidden [S, I]`` from
its gate-up), program (token ``t``, ``BLOCK_N`` output columns):

1. reads every one of ``t``'s slots' ``w2`` rows for its columns (their first ``BLOCK_K``
   columns, the whole rows where ``BLOCK_K >= I``) before its PDL wait: the gate-up let the
   down launch only after its own wait, so the router's ids are final;
2. after the wait, lets the next kernel launch (the programs are all resident at once: a
   release before the wait would launch it while the gate-up still runs), then computes each
   slot's columns as the down does (``down_dots``), rounds each to the output dtype, sums
   them in slot order in fp32, adds the residual and rounds once: ``summed[t, columns]``,
   the new residual stream, as ``add_rms_norm`` computes it;
3. counts itself done for ``t`` (a counter per token, a release / acquire ``atomic_add``
   after a barrier); the last of ``t``'s programs reads the whole ``summed[t]`` row and
   writes its RMSNorm, ``normed[t]``, then zeroes the counter for the next launch.

The norm's sum of squares runs over the row in the last program, in another order than
``add_rms_norm``'s kernel: ``normed`` may differ from the two kernels' in the last bit of
a few elements. No host syncs: capturable in a CUDA graph. Launched with programmatic
dependent launch in small decode steps (``qllm.plugins.pdl``), like the down.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qllm.plugins.pdl import pdl_arguments, pdl_release, pdl_wait
from qllm_kernels_linear.triton_norm import rms_normed
from qllm_kernels_moe.configs import GemmConfig
from qllm_kernels_moe.triton_slot_moe import down_dots, expert_rows, slot_counters

# The weight tiles a thread holds before the wait, all of a token's slots at once: at most
# this many elements (64 registers of bf16 pairs); the launch takes the warps that keep them so.
TILE_ELEMENTS_PER_THREAD = 128
MAX_NUM_WARPS = 16


@triton.jit
def _slot_down_add_norm_kernel(hidden_ptr, w_ptr, shared_w_ptr, ids_ptr, routing_weights_ptr,
                               residual_ptr, norm_weight_ptr, normed_ptr, summed_ptr,
                               counters_ptr, eps, num_experts, N, K, stride_w_expert,
                               stride_w_row, stride_residual, TOP_K: tl.constexpr,
                               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                               WHOLE_K: tl.constexpr, BLOCK_D: tl.constexpr,
                               ZERO_CENTERED: tl.constexpr, USE_PDL: tl.constexpr):
    """``summed[t, n] = round(sum_j round(routing_weights[s] * (hidden[s] . w[e_s, n])) +
    residual[t, n])`` over token ``t``'s slots ``s = t * TOP_K + j`` (expert ``e_s``,
    ``num_experts``: ``shared_w``), then, in ``t``'s last program, ``normed[t] =
    rms_norm(summed[t])`` (module docstring)."""
    token = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    row_mask = rows < N
    ks = tl.arange(0, BLOCK_K)
    offsets = rows[:, None] * stride_w_row + ks[None, :]  # [BN, BK]
    first = row_mask[:, None] & (ks < K)[None, :]
    pointers, tiles = (), ()  # per slot: [BN, BK] each, read before the wait
    for j in tl.static_range(TOP_K):
        expert = tl.load(ids_ptr + token * TOP_K + j, cache_modifier=".cg")
        w_ptrs = expert_rows(w_ptr, shared_w_ptr, expert, num_experts, stride_w_expert,
                              offsets)
        pointers = pointers + (w_ptrs,)
        tiles = tiles + (tl.load(w_ptrs, mask=first, other=0.0),)
    residual = tl.load(residual_ptr + token * stride_residual + rows, mask=row_mask, other=0.0)
    pdl_wait(USE_PDL)  # hidden is the gate-up's output
    pdl_release(USE_PDL)  # only now (module docstring)
    branch = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in tl.static_range(TOP_K):  # the slots in order, each rounded as the down's output
        out = down_dots(hidden_ptr, routing_weights_ptr, token * TOP_K + j, row_mask, ks,
                         pointers[j], tiles[j], K, BLOCK_K, WHOLE_K)  # [BN]
        branch += out.to(summed_ptr.dtype.element_ty).to(tl.float32)
    summed = (branch + residual.to(tl.float32)).to(summed_ptr.dtype.element_ty)
    tl.store(summed_ptr + token * N + rows, summed, mask=row_mask)
    tl.debug_barrier()  # every thread's store ordered before the count
    done = tl.atomic_add(counters_ptr + token, 1, sem="acq_rel")
    if done == tl.num_programs(1) - 1:  # the token's last program: the whole row is stored
        dims = tl.arange(0, BLOCK_D)
        mask = dims < N
        row = tl.load(summed_ptr + token * N + dims, mask=mask, other=0.0,
                      cache_modifier=".cg")  # [D]
        weight = tl.load(norm_weight_ptr + dims, mask=mask, other=0.0).to(tl.float32)
        tl.store(normed_ptr + token * N + dims, rms_normed(row, weight, eps, N, ZERO_CENTERED),
                 mask=mask)
        tl.store(counters_ptr + token, 0)


def slot_down_add_norm_warps(top_k: int, config: GemmConfig) -> int:
    """Warps for ``config``'s tiles of all ``top_k`` slots held at once: the down's own, or
    more where a thread would otherwise hold over ``TILE_ELEMENTS_PER_THREAD`` elements."""
    elements = top_k * config.BLOCK_N * config.BLOCK_K
    needed = triton.next_power_of_2(triton.cdiv(elements, 32 * TILE_ELEMENTS_PER_THREAD))
    return min(MAX_NUM_WARPS, max(config.num_warps, needed))


def slot_down_add_norm(hidden: torch.Tensor, w2: torch.Tensor, shared_w2: torch.Tensor,
                       topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                       residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                       zero_centered: bool, config: GemmConfig
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """GEMM 2 per slot, then the residual add and the RMSNorm: ``hidden [T * k, I]``
    (contiguous) through each slot's expert of ``w2 [E, H, I]`` (expert ``E``: ``shared_w2
    [H, I]``), times ``topk_weights [T, k]``, summed per token with ``residual [T, H]`` (unit
    last stride) -> ``(rms_norm(summed), summed)``, both ``[T, H]`` in ``residual.dtype``;
    ``config``: the down's tiles (``BLOCK_N`` output columns a program)."""
    tokens, top_k = topk_ids.shape
    inter, hidden_size = hidden.shape[1], w2.shape[1]
    normed, summed = residual.new_empty(tokens, hidden_size), residual.new_empty(tokens,
                                                                                 hidden_size)
    if tokens == 0:
        return normed, summed
    grid = (tokens, triton.cdiv(hidden_size, config.BLOCK_N))
    _slot_down_add_norm_kernel[grid](
        hidden, w2, shared_w2, topk_ids, topk_weights, residual, norm_weight, normed, summed,
        slot_counters(residual.device, tokens), eps, w2.shape[0], hidden_size, inter,
        w2.stride(0), w2.stride(1), residual.stride(0), TOP_K=top_k, BLOCK_N=config.BLOCK_N,
        BLOCK_K=config.BLOCK_K, WHOLE_K=config.BLOCK_K >= inter,
        BLOCK_D=triton.next_power_of_2(hidden_size), ZERO_CENTERED=zero_centered,
        num_warps=slot_down_add_norm_warps(top_k, config), num_stages=config.num_stages,
        **pdl_arguments(residual.device, tokens))
    return normed, summed
