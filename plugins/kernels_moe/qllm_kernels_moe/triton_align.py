"""``moe_align`` for decode-sized batches as one Triton program (one launch instead of the ~12
sort, search and scan kernels of the torch version).

Each slot takes a rank within its expert from an atomic counter per expert (the counts are
then final: their order of adds does not change a count); a cumulative sum of the counts
rounded up to ``BLOCK_M`` places each expert's run; each slot lands at its run's start plus
its rank, and each run's tail gets the padding sentinel ``S``. No sort and no pass over the
whole padded list: the work is ``S`` atomics plus ``E * BLOCK_M`` sentinel stores, so one
program serves up to ``MAX_SLOTS`` slots (decode batches of up to 512 tokens at 9 slots); larger
(prefill) batches take the torch version.

The output equals the torch version's on the blocks in use, except for the order of the slots
within an expert's run, which follows the atomics (the torch version's stable sort lists them
ascending). The grouped GEMMs compute every slot's row on its own, so the MoE output is bitwise
the same whatever that order. Entries past the blocks in use are left unwritten: the GEMMs never
read them. (``tl.histogram`` would count in registers, but its lowering has had bugs with
replicated layouts, which small batches produce.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qllm_kernels_moe.align import SortedSlots, max_padded_slots

MAX_SLOTS = 512 * 9  # decode batches of up to 512 tokens at top-8 plus the shared expert


@triton.jit
def _align_kernel(ids_ptr, slots_ptr, block_experts_ptr, num_blocks_ptr, counts_ptr,
                  run_starts_ptr, num_slots, num_experts, padded_blocks,
                  BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, S_PAD: tl.constexpr,
                  B_PAD: tl.constexpr):
    experts = tl.arange(0, E_PAD)  # [E]
    position = tl.arange(0, S_PAD)  # [S]
    in_range = position < num_slots

    # 1. each slot's rank within its expert; the counters end as the counts
    ids = tl.load(ids_ptr + position, mask=in_range, other=0).to(tl.int32)  # [S]
    tl.store(counts_ptr + experts, tl.zeros([E_PAD], dtype=tl.int32))
    tl.debug_barrier()
    rank = tl.atomic_add(counts_ptr + ids, tl.full([S_PAD], 1, tl.int32), mask=in_range)
    tl.debug_barrier()
    counts = tl.load(counts_ptr + experts, volatile=True)  # [E]

    # 2. padded runs: expert e owns blocks [first[e], first[e] + blocks[e])
    blocks = (counts + BLOCK_M - 1) // BLOCK_M  # [E]
    first = tl.cumsum(blocks, axis=0) - blocks  # [E]
    total = tl.sum(blocks, axis=0)
    tl.store(num_blocks_ptr, total.to(tl.int64))
    tl.store(run_starts_ptr + experts, first * BLOCK_M)
    for j in range(0, tl.max(blocks, axis=0)):
        tl.store(block_experts_ptr + first + j, experts.to(tl.int64), mask=j < blocks)
    unused = tl.arange(0, B_PAD)  # [B]: blocks past the used ones name no expert
    tl.store(block_experts_ptr + unused, tl.full([B_PAD], 0, tl.int64) + num_experts,
             mask=(unused >= total) & (unused < padded_blocks))
    # each run's tail past its slots is padding
    tail = first[:, None] * BLOCK_M + counts[:, None] + tl.arange(0, BLOCK_M)[None, :]  # [E, BM]
    tl.store(slots_ptr + tail, tl.full([E_PAD, BLOCK_M], 0, tl.int64) + num_slots,
             mask=tail < (first + blocks)[:, None] * BLOCK_M)
    tl.debug_barrier()

    # 3. each slot at its run's start plus its rank
    run_start = tl.load(run_starts_ptr + ids, mask=in_range, other=0, volatile=True)  # [S]
    tl.store(slots_ptr + run_start + rank, position.to(tl.int64), mask=in_range)


def moe_align_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> SortedSlots:
    """``moe_align`` (see ``qllm_kernels_moe.align``) in one launch, up to the order within
    each expert's run (module docstring); ``topk_ids [T, k]`` with ``T * k <= MAX_SLOTS``."""
    num_slots = topk_ids.numel()
    if num_slots > MAX_SLOTS:
        raise ValueError(f"{num_slots} slots: the one-program align serves up to {MAX_SLOTS}")
    padded = max_padded_slots(num_slots, num_experts, block_m)
    device = topk_ids.device
    slots = torch.empty(padded, dtype=torch.int64, device=device)
    block_experts = torch.empty(padded // block_m, dtype=torch.int64, device=device)
    num_blocks = torch.empty(1, dtype=torch.int64, device=device)
    expert_pad = triton.next_power_of_2(num_experts)
    counts, run_starts = torch.empty(2, expert_pad, dtype=torch.int32, device=device)  # scratch
    slot_pad = max(triton.next_power_of_2(num_slots), 16)
    _align_kernel[(1,)](
        topk_ids.reshape(-1), slots, block_experts, num_blocks, counts, run_starts,
        num_slots, num_experts, padded // block_m,
        BLOCK_M=block_m, E_PAD=expert_pad, S_PAD=slot_pad,
        B_PAD=triton.next_power_of_2(padded // block_m), num_warps=4 if slot_pad <= 1024 else 8)
    return SortedSlots(slots, block_experts, num_blocks)
