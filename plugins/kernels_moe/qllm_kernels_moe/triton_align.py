"""``moe_align`` for decode-sized batches in one launch (instead of the ~12 sort, search and
scan kernels of the torch version), one program per expert.

Every program reads all the slots' expert ids and counts them per expert (``tl.histogram``), so
each knows every expert's count and, by a cumulative sum of the counts rounded up to
``BLOCK_M``, where each expert's run starts. Program ``e`` then writes its own run: its slots in
ascending order (a cumulative sum over the slots ``== e`` ranks them), its run's padding, and
the expert id of its blocks; program 0 also writes the number of blocks in use and marks the
later blocks as naming no expert. No atomics and no barrier: the output equals the torch
version's on the blocks in use, slot for slot. Entries past the blocks in use are left unwritten
(the GEMMs never read them).

One program holds every slot in registers, so up to ``MAX_SLOTS`` slots (decode batches of up
to 512 tokens at 9 slots) take this path; larger (prefill) batches take the torch version.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qllm_kernels_moe.align import SortedSlots, max_padded_slots

MAX_SLOTS = 512 * 9  # decode batches of up to 512 tokens at top-8 plus the shared expert
NUM_WARPS = 4
# Vectors at least one element per thread: tl.histogram has miscounted with replicated layouts.
MIN_VECTOR = 32 * NUM_WARPS


@triton.jit
def _align_kernel(ids_ptr, slots_ptr, block_experts_ptr, num_blocks_ptr, num_slots,
                  num_experts, padded_blocks, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr,
                  S_PAD: tl.constexpr, B_PAD: tl.constexpr):
    expert = tl.program_id(0)
    position = tl.arange(0, S_PAD)  # [S]
    in_range = position < num_slots
    # slots past the end count in the last bin, which no expert owns (E_PAD > num_experts)
    ids = tl.load(ids_ptr + position, mask=in_range, other=E_PAD - 1).to(tl.int32)  # [S]

    # every expert's run: expert e owns blocks [first[e], first[e] + blocks[e])
    counts = tl.histogram(ids, E_PAD)  # [E]
    experts = tl.arange(0, E_PAD)  # [E]
    blocks = tl.where(experts < num_experts, (counts + BLOCK_M - 1) // BLOCK_M, 0)  # [E]
    first = tl.cumsum(blocks, axis=0) - blocks  # [E]
    own = experts == expert
    run_start = tl.sum(tl.where(own, first, 0), axis=0) * BLOCK_M
    run_blocks = tl.sum(tl.where(own, blocks, 0), axis=0)
    count = tl.sum(tl.where(own, counts, 0), axis=0)

    # this expert's slots in ascending order, then its padding, then its blocks' expert id
    mine = ids == expert  # [S]
    rank = tl.cumsum(mine.to(tl.int32), axis=0) - 1  # [S]
    tl.store(slots_ptr + run_start + rank, position.to(tl.int64), mask=mine)
    tail = run_start + count + tl.arange(0, BLOCK_M)  # [BM]
    tl.store(slots_ptr + tail, tl.full([BLOCK_M], 0, tl.int64) + num_slots,
             mask=tail < run_start + run_blocks * BLOCK_M)
    block = tl.arange(0, B_PAD)  # [B]
    tl.store(block_experts_ptr + run_start // BLOCK_M + block,
             tl.full([B_PAD], 0, tl.int64) + expert, mask=block < run_blocks)

    if expert == 0:  # blocks past the used ones name no expert
        total = tl.sum(blocks, axis=0)
        tl.store(num_blocks_ptr, total.to(tl.int64))
        tl.store(block_experts_ptr + block, tl.full([B_PAD], 0, tl.int64) + num_experts,
                 mask=(block >= total) & (block < padded_blocks))


def moe_align_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> SortedSlots:
    """``moe_align`` (see ``qllm_kernels_moe.align``) in one launch, with the same output on
    the blocks in use; ``topk_ids [T, k]`` with ``T * k <= MAX_SLOTS``."""
    num_slots = topk_ids.numel()
    if num_slots > MAX_SLOTS:
        raise ValueError(f"{num_slots} slots: the one-launch align serves up to {MAX_SLOTS}")
    padded = max_padded_slots(num_slots, num_experts, block_m)
    device = topk_ids.device
    slots = torch.empty(padded, dtype=torch.int64, device=device)
    block_experts = torch.empty(padded // block_m, dtype=torch.int64, device=device)
    num_blocks = torch.empty(1, dtype=torch.int64, device=device)
    _align_kernel[(num_experts,)](
        topk_ids.reshape(-1), slots, block_experts, num_blocks, num_slots, num_experts,
        padded // block_m, BLOCK_M=block_m,
        E_PAD=max(triton.next_power_of_2(num_experts + 1), MIN_VECTOR),
        S_PAD=max(triton.next_power_of_2(num_slots), MIN_VECTOR),
        B_PAD=triton.next_power_of_2(padded // block_m), num_warps=NUM_WARPS)
    return SortedSlots(slots, block_experts, num_blocks)
