"""``moe_align`` for decode-sized batches as one Triton program (one launch instead of the ~12
sort, search and scan kernels of the torch version; the same output, entry for entry).

The program holds every slot's key ``expert * S_PAD + slot`` in registers and sorts them
(``tl.sort``, a bitonic network): the sorted keys are the slots grouped by expert, ascending
within an expert, as in the torch version's stable sort. Per-expert counts (atomic adds into
a scratch row: the order of the adds does not change a count) give each expert's sorted
start and padded run start; a sorted slot at position ``p`` of expert ``e`` lands at ``p``
plus the padding inserted before ``e``'s run. (``tl.histogram`` would count in registers,
but its lowering has had bugs with replicated layouts, which small batches produce.) The
work is ``S log^2 S`` compare-exchanges plus ``E`` per expert, so one program serves up to
``MAX_SLOTS`` slots (decode batches of up to 512 tokens at top-8); larger (prefill) batches
take the torch version.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qllm_kernels_moe.align import SortedSlots, max_padded_slots

MAX_SLOTS = 4096
# The fused op takes this kernel for every batch it serves: in W2's decode graph on the H200
# (1,600 slots) it takes 36 us per layer against 58 us for the torch sort's 19 kernels. A
# two-launch variant (counts and layout in one program, then a scatter ranking each slot among
# the earlier slots of its expert, 128 slots per program) took 21 + 41 us there and was
# dropped (benchmarks/RESULTS.md, 2026-11-30).
PREFERRED_UP_TO = MAX_SLOTS
FILL_CHUNK = 1024  # padding entries written per iteration
BLOCKS_CHUNK = 64  # blocks whose expert is resolved per iteration


@triton.jit
def _align_kernel(ids_ptr, slots_ptr, block_experts_ptr, num_blocks_ptr, counts_ptr, shift_ptr,
                  num_slots, num_experts, padded,
                  BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, S_PAD: tl.constexpr,
                  FILL_CHUNK: tl.constexpr, BLOCKS_CHUNK: tl.constexpr):
    experts = tl.arange(0, E_PAD)  # [E]
    position = tl.arange(0, S_PAD)  # [S]
    in_range = position < num_slots

    # 1. slots per expert
    ids = tl.load(ids_ptr + position, mask=in_range, other=0).to(tl.int32)  # [S]
    tl.store(counts_ptr + experts, tl.zeros([E_PAD], dtype=tl.int32))
    tl.debug_barrier()
    tl.atomic_add(counts_ptr + ids, tl.full([S_PAD], 1, tl.int32), mask=in_range)
    tl.debug_barrier()
    counts = tl.load(counts_ptr + experts, volatile=True)  # [E], written by the atomics

    # 2. padded runs: expert e owns blocks [ends[e] - blocks[e], ends[e]); the padding
    #    inserted before e's run is its padded start minus its sorted start
    blocks = (counts + BLOCK_M - 1) // BLOCK_M  # [E]
    ends = tl.cumsum(blocks, axis=0)  # [E]
    sorted_starts = tl.cumsum(counts, axis=0) - counts  # [E]
    tl.store(shift_ptr + experts, (ends - blocks) * BLOCK_M - sorted_starts)
    tl.store(num_blocks_ptr, tl.sum(blocks, axis=0).to(tl.int64))
    for first in range(0, padded // BLOCK_M, BLOCKS_CHUNK):
        block = first + tl.arange(0, BLOCKS_CHUNK)  # [B]
        owner = tl.sum((ends[None, :] <= block[:, None]).to(tl.int32), axis=1)  # [B]
        tl.store(block_experts_ptr + block, tl.minimum(owner, num_experts).to(tl.int64),
                 mask=block < padded // BLOCK_M)

    # 3. every entry starts as padding (the sentinel num_slots) ...
    for first in range(0, padded, FILL_CHUNK):
        entry = first + tl.arange(0, FILL_CHUNK)
        tl.store(slots_ptr + entry, tl.full([FILL_CHUNK], 0, tl.int64) + num_slots,
                 mask=entry < padded)
    tl.debug_barrier()

    # 4. ... then the slots sorted by (expert, slot) go to their position plus their
    #    expert's shift; out-of-range lanes sort last (key E_PAD * S_PAD) and are dropped
    keys = tl.where(in_range, ids * S_PAD + position, E_PAD * S_PAD)  # [S]
    keys = tl.sort(keys)
    expert, slot = keys // S_PAD, keys % S_PAD
    dest = position + tl.load(shift_ptr + expert, mask=in_range, other=0, volatile=True)
    tl.store(slots_ptr + dest, slot.to(tl.int64), mask=in_range)


def moe_align_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> SortedSlots:
    """``moe_align`` (see ``qllm_kernels_moe.align``) in one launch; ``topk_ids [T, k]`` with
    ``T * k <= MAX_SLOTS``."""
    num_slots = topk_ids.numel()
    if num_slots > MAX_SLOTS:
        raise ValueError(f"{num_slots} slots: the one-program align serves up to {MAX_SLOTS}")
    padded = max_padded_slots(num_slots, num_experts, block_m)
    device = topk_ids.device
    slots = torch.empty(padded, dtype=torch.int64, device=device)
    block_experts = torch.empty(padded // block_m, dtype=torch.int64, device=device)
    num_blocks = torch.empty(1, dtype=torch.int64, device=device)
    expert_pad = triton.next_power_of_2(num_experts)
    counts, shift = torch.empty(2, expert_pad, dtype=torch.int32, device=device)  # scratch
    slot_pad = max(triton.next_power_of_2(num_slots), 16)
    _align_kernel[(1,)](
        topk_ids.reshape(-1), slots, block_experts, num_blocks, counts, shift,
        num_slots, num_experts, padded,
        BLOCK_M=block_m, E_PAD=expert_pad, S_PAD=slot_pad, FILL_CHUNK=FILL_CHUNK,
        BLOCKS_CHUNK=BLOCKS_CHUNK, num_warps=4 if slot_pad <= 1024 else 8)
    return SortedSlots(slots, block_experts, num_blocks)
