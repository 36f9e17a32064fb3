"""``moe_align`` for decode-sized batches as one Triton program (one launch instead of the ~12
sort, search and scan kernels of the torch version).

Per-expert counts (atomic adds into a scratch row: the order of the adds does not change a
count) give each expert's padded run; every entry is set to padding (the sentinel ``S``);
then each slot takes the next free entry of its expert's run through an atomic cursor per
expert. No sort: the work is ``S`` atomics twice plus ``E`` per block, so one program serves
up to ``MAX_SLOTS`` slots (decode batches of up to 512 tokens at top-8); larger (prefill)
batches take the torch version.

The output equals the torch version's except for the order of the slots within an expert's
run, which follows the atomics (the torch version's stable sort lists them ascending). The
grouped GEMMs compute every slot's row on its own, so the MoE output is bitwise the same
whatever that order. (``tl.histogram`` would count in registers, but its lowering has had bugs
with replicated layouts, which small batches produce.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qllm_kernels_moe.align import SortedSlots, max_padded_slots

MAX_SLOTS = 4096
FILL_CHUNK = 1024  # padding entries written per iteration
BLOCKS_CHUNK = 64  # blocks whose expert is resolved per iteration


@triton.jit
def _align_kernel(ids_ptr, slots_ptr, block_experts_ptr, num_blocks_ptr, counts_ptr,
                  run_starts_ptr, cursors_ptr, num_slots, num_experts, padded,
                  BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, S_PAD: tl.constexpr,
                  FILL_CHUNK: tl.constexpr, BLOCKS_CHUNK: tl.constexpr):
    experts = tl.arange(0, E_PAD)  # [E]
    position = tl.arange(0, S_PAD)  # [S]
    in_range = position < num_slots

    # 1. slots per expert
    ids = tl.load(ids_ptr + position, mask=in_range, other=0).to(tl.int32)  # [S]
    tl.store(counts_ptr + experts, tl.zeros([E_PAD], dtype=tl.int32))
    tl.store(cursors_ptr + experts, tl.zeros([E_PAD], dtype=tl.int32))
    tl.debug_barrier()
    tl.atomic_add(counts_ptr + ids, tl.full([S_PAD], 1, tl.int32), mask=in_range)
    tl.debug_barrier()
    counts = tl.load(counts_ptr + experts, volatile=True)  # [E], written by the atomics

    # 2. padded runs: expert e owns blocks [ends[e] - blocks[e], ends[e])
    blocks = (counts + BLOCK_M - 1) // BLOCK_M  # [E]
    ends = tl.cumsum(blocks, axis=0)  # [E]
    tl.store(run_starts_ptr + experts, (ends - blocks) * BLOCK_M)
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

    # 4. ... then each slot takes the next free entry of its expert's run
    rank = tl.atomic_add(cursors_ptr + ids, tl.full([S_PAD], 1, tl.int32), mask=in_range)
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
    counts, run_starts, cursors = torch.empty(3, expert_pad, dtype=torch.int32,
                                              device=device)  # scratch
    slot_pad = max(triton.next_power_of_2(num_slots), 16)
    _align_kernel[(1,)](
        topk_ids.reshape(-1), slots, block_experts, num_blocks, counts, run_starts, cursors,
        num_slots, num_experts, padded,
        BLOCK_M=block_m, E_PAD=expert_pad, S_PAD=slot_pad, FILL_CHUNK=FILL_CHUNK,
        BLOCKS_CHUNK=BLOCKS_CHUNK, num_warps=4 if slot_pad <= 1024 else 8)
    return SortedSlots(slots, block_experts, num_blocks)
