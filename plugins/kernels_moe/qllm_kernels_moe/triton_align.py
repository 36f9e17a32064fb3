"""``moe_align`` for decode-sized batches in two Triton launches (instead of the ~12 sort,
search and scan kernels of the torch version; the same output, entry for entry).

1. ``_layout_kernel`` (one program): slots per expert (atomic adds into a scratch row: the
   order of the adds does not change a count), each expert's padded run start, the expert
   of every block, the count of blocks in use, and every entry of the list set to padding
   (the sentinel ``S``).
2. ``_scatter_kernel`` (one program per ``CHUNK`` slots): a slot's rank within its expert is
   the number of earlier slots routed to the same expert (compared tile by tile), and the
   slot lands at its expert's run start plus that rank. Ranks by slot id make the order
   within an expert ascending, as the torch version's stable sort does.

The rank comparison is ``S^2 / 2`` in all, spread over ``S / CHUNK`` programs: cheap at decode
sizes, so the kernels serve up to ``MAX_SLOTS`` slots (decode batches of up to 512 tokens at
top-8); larger (prefill) batches take the torch sort.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qllm_kernels_moe.align import SortedSlots, max_padded_slots

MAX_SLOTS = 4096
CHUNK = 128  # slots per program of the scatter, and per tile of its rank comparison
FILL_CHUNK = 1024  # padding entries written per iteration
BLOCKS_CHUNK = 64  # blocks whose expert is resolved per iteration


@triton.jit
def _layout_kernel(ids_ptr, block_experts_ptr, num_blocks_ptr, slots_ptr, counts_ptr,
                   run_starts_ptr, num_slots, num_experts, padded,
                   BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr,
                   FILL_CHUNK: tl.constexpr, BLOCKS_CHUNK: tl.constexpr):
    experts = tl.arange(0, E_PAD)  # [E]

    # slots per expert
    tl.store(counts_ptr + experts, tl.zeros([E_PAD], dtype=tl.int32))
    tl.debug_barrier()
    for first in range(0, num_slots, CHUNK):
        slot = first + tl.arange(0, CHUNK)  # [C]
        ids = tl.load(ids_ptr + slot, mask=slot < num_slots, other=0).to(tl.int32)
        tl.atomic_add(counts_ptr + ids, tl.full([CHUNK], 1, tl.int32), mask=slot < num_slots)
    tl.debug_barrier()
    counts = tl.load(counts_ptr + experts, volatile=True)  # [E], written by the atomics

    # padded runs: expert e owns blocks [ends[e] - blocks[e], ends[e])
    blocks = (counts + BLOCK_M - 1) // BLOCK_M  # [E]
    ends = tl.cumsum(blocks, axis=0)  # [E]
    tl.store(run_starts_ptr + experts, (ends - blocks) * BLOCK_M)
    tl.store(num_blocks_ptr, tl.sum(blocks, axis=0).to(tl.int64))
    for first in range(0, padded // BLOCK_M, BLOCKS_CHUNK):
        block = first + tl.arange(0, BLOCKS_CHUNK)  # [B]
        owner = tl.sum((ends[None, :] <= block[:, None]).to(tl.int32), axis=1)  # [B]
        tl.store(block_experts_ptr + block, tl.minimum(owner, num_experts).to(tl.int64),
                 mask=block < padded // BLOCK_M)

    # every entry starts as padding; the scatter then writes the slots over their entries
    for first in range(0, padded, FILL_CHUNK):
        entry = first + tl.arange(0, FILL_CHUNK)
        tl.store(slots_ptr + entry, tl.full([FILL_CHUNK], 0, tl.int64) + num_slots,
                 mask=entry < padded)


@triton.jit
def _scatter_kernel(ids_ptr, slots_ptr, run_starts_ptr, num_slots, CHUNK: tl.constexpr):
    first = tl.program_id(0) * CHUNK
    slot = first + tl.arange(0, CHUNK)  # [C]: this program's slots
    in_range = slot < num_slots
    ids = tl.load(ids_ptr + slot, mask=in_range, other=-1).to(tl.int32)  # [C]
    rank = tl.zeros([CHUNK], dtype=tl.int32)  # earlier slots of the same expert
    for tile in range(0, first + CHUNK, CHUNK):
        other = tile + tl.arange(0, CHUNK)  # [C]
        other_ids = tl.load(ids_ptr + other, mask=other < num_slots, other=-2).to(tl.int32)
        same = (other_ids[None, :] == ids[:, None]) & (other[None, :] < slot[:, None])
        rank += tl.sum(same.to(tl.int32), axis=1)
    run_start = tl.load(run_starts_ptr + ids, mask=in_range, other=0)  # [C]
    tl.store(slots_ptr + run_start + rank, slot.to(tl.int64), mask=in_range)


def moe_align_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> SortedSlots:
    """``moe_align`` (see ``qllm_kernels_moe.align``) in two launches; ``topk_ids [T, k]``
    with ``T * k <= MAX_SLOTS``."""
    num_slots = topk_ids.numel()
    if num_slots > MAX_SLOTS:
        raise ValueError(f"{num_slots} slots: the Triton align serves up to {MAX_SLOTS}")
    padded = max_padded_slots(num_slots, num_experts, block_m)
    device = topk_ids.device
    ids = topk_ids.reshape(-1)
    slots = torch.empty(padded, dtype=torch.int64, device=device)
    block_experts = torch.empty(padded // block_m, dtype=torch.int64, device=device)
    num_blocks = torch.empty(1, dtype=torch.int64, device=device)
    expert_pad = triton.next_power_of_2(num_experts)
    counts, run_starts = torch.empty(2, expert_pad, dtype=torch.int32, device=device)  # scratch
    _layout_kernel[(1,)](
        ids, block_experts, num_blocks, slots, counts, run_starts,
        num_slots, num_experts, padded,
        BLOCK_M=block_m, E_PAD=expert_pad, CHUNK=CHUNK, FILL_CHUNK=FILL_CHUNK,
        BLOCKS_CHUNK=BLOCKS_CHUNK, num_warps=4)
    _scatter_kernel[(triton.cdiv(num_slots, CHUNK),)](
        ids, slots, run_starts, num_slots, CHUNK=CHUNK, num_warps=4)
    return SortedSlots(slots, block_experts, num_blocks)
