"""``moe_align`` in Triton: a few launches instead of the ~12 sort, search and scan kernels of
the torch version.

Every expert's run follows from the counts of all experts: a cumulative sum of the counts rounded
up to ``BLOCK_M`` says where each run starts. Program ``e`` then writes its own run: its slots in
ascending order (a cumulative sum over the slots ``== e`` ranks them), its run's padding and the
expert id of its blocks; program 0 also writes the number of blocks in use and marks the later
blocks as naming no expert. No sort: the output equals the torch version's on the blocks in use,
slot for slot. Entries past the blocks in use are left unwritten (the GEMMs never read them).

- Up to ``MAX_SLOTS`` slots (decode batches of up to 512 tokens at 9 slots): one launch, one
  program per expert, each counting every slot itself (``tl.histogram`` over vectors of
  ``SLOT_VECTOR`` slots), then walking the slots again to place its own.
- More (prefill): the slots in chunks of ``CHUNK`` (the same count per chunk, in registers).
  One launch counts each chunk and adds its counts to the totals (atomics on ``E`` counters);
  then one program per (expert, chunk) ranks the expert's slots of its chunk after those of
  the earlier chunks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qllm_kernels_moe.align import SortedSlots, max_padded_slots

MAX_SLOTS = 512 * 9  # decode batches of up to 512 tokens at top-8 plus the shared expert
CHUNK = 4096  # slots per program past MAX_SLOTS
NUM_WARPS = 4
# Vector widths of the loops over slots, blocks and earlier chunks. They are fixed, not sized
# to the step: a launch parameter that follows the slot count would compile a kernel variant
# per size class, in the middle of serving (W2's last prefill step lost about 0.5 s to one;
# the slot vector was the next power of two of the slot count until 2026-12-03: 7 compiles
# of about 1 s in W3's start-up, one per prefill bucket).
SLOT_VECTOR = tl.constexpr(1024)
BLOCK_VECTOR = tl.constexpr(128)
CHUNK_VECTOR = tl.constexpr(64)
# Vectors at least one element per thread: tl.histogram has miscounted with replicated layouts.
MIN_VECTOR = 32 * NUM_WARPS
# The slot and block counts follow the step's token count. Triton would compile a variant per
# divisibility class of each (by 16 or not), and a step of a class the start-up warm-up missed
# would compile in the middle of serving; they bound masks and loops only, so one variant serves.
SIZE_ARGUMENTS = ["num_slots", "padded_blocks"]


@triton.jit
def _write_run(slots_ptr, block_experts_ptr, num_blocks_ptr, ids, position, rank_base, counts,
               expert, num_slots, num_experts, padded_blocks, WRITE_RUN_TAIL,
               BLOCK_M: tl.constexpr, E_PAD: tl.constexpr):
    """Place ``expert``'s slots among ``ids [S]`` (slot ids ``position``) at its run's start
    plus ``rank_base`` plus their rank, from every expert's ``counts [E_PAD]``. With
    ``WRITE_RUN_TAIL`` also its run's padding and blocks (and, for expert 0, the used count and
    the unused blocks)."""
    # expert e owns blocks [first[e], first[e] + blocks[e])
    experts = tl.arange(0, E_PAD)  # [E]
    blocks = tl.where(experts < num_experts, (counts + BLOCK_M - 1) // BLOCK_M, 0)  # [E]
    first = tl.cumsum(blocks, axis=0) - blocks  # [E]
    own = experts == expert
    run_start = tl.sum(tl.where(own, first, 0), axis=0) * BLOCK_M

    mine = ids == expert  # [S]
    rank = rank_base + tl.cumsum(mine.to(tl.int32), axis=0) - 1  # [S]
    tl.store(slots_ptr + run_start + rank, position.to(tl.int64), mask=mine)
    if WRITE_RUN_TAIL:
        run_blocks = tl.sum(tl.where(own, blocks, 0), axis=0)
        count = tl.sum(tl.where(own, counts, 0), axis=0)
        tail = run_start + count + tl.arange(0, BLOCK_M)  # [BM]
        tl.store(slots_ptr + tail, tl.full([BLOCK_M], 0, tl.int64) + num_slots,
                 mask=tail < run_start + run_blocks * BLOCK_M)
        for base in range(0, run_blocks, BLOCK_VECTOR):
            block = base + tl.arange(0, BLOCK_VECTOR)  # [B]
            tl.store(block_experts_ptr + run_start // BLOCK_M + block,
                     tl.full([BLOCK_VECTOR], 0, tl.int64) + expert, mask=block < run_blocks)
        if expert == 0:  # blocks past the used ones name no expert
            total = tl.sum(blocks, axis=0)
            tl.store(num_blocks_ptr, total.to(tl.int64))
            for base in range(total, padded_blocks, BLOCK_VECTOR):
                block = base + tl.arange(0, BLOCK_VECTOR)  # [B]
                tl.store(block_experts_ptr + block,
                         tl.full([BLOCK_VECTOR], 0, tl.int64) + num_experts,
                         mask=block < padded_blocks)


@triton.jit
def _load_ids(ids_ptr, position, num_slots, E_PAD: tl.constexpr):
    """Expert ids of the slots at ``position``; slots past the end count in the last bin,
    which no expert owns (``E_PAD > num_experts``)."""
    return tl.load(ids_ptr + position, mask=position < num_slots, other=E_PAD - 1).to(tl.int32)


@triton.jit(do_not_specialize=SIZE_ARGUMENTS)
def _align_kernel(ids_ptr, slots_ptr, block_experts_ptr, num_blocks_ptr, num_slots,
                  num_experts, padded_blocks, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr):
    """All slots in one program per expert: every expert's count, then its own slots in
    order."""
    expert = tl.program_id(0)
    counts = tl.zeros([E_PAD], tl.int32)  # [E]
    for base in range(0, num_slots, SLOT_VECTOR):
        position = base + tl.arange(0, SLOT_VECTOR)  # [S]
        counts += tl.histogram(_load_ids(ids_ptr, position, num_slots, E_PAD), E_PAD)
    placed = 0  # this expert's slots before the vector
    for base in range(0, tl.maximum(num_slots, 1), SLOT_VECTOR):  # once at least: the tail
        position = base + tl.arange(0, SLOT_VECTOR)  # [S]
        ids = _load_ids(ids_ptr, position, num_slots, E_PAD)
        _write_run(slots_ptr, block_experts_ptr, num_blocks_ptr, ids, position, placed,
                   counts, expert, num_slots, num_experts, padded_blocks, base == 0,
                   BLOCK_M, E_PAD)
        placed += tl.sum((ids == expert).to(tl.int32), axis=0)


@triton.jit(do_not_specialize=["num_slots"])  # the one of SIZE_ARGUMENTS it takes
def _chunk_counts_kernel(ids_ptr, chunk_counts_ptr, totals_ptr, num_slots,
                         E_PAD: tl.constexpr, CHUNK: tl.constexpr):
    """Chunk ``c``'s count per expert into ``chunk_counts[c]``, added to ``totals``."""
    chunk = tl.program_id(0)
    position = chunk * CHUNK + tl.arange(0, CHUNK)  # [S]
    counts = tl.histogram(_load_ids(ids_ptr, position, num_slots, E_PAD), E_PAD)  # [E]
    experts = tl.arange(0, E_PAD)
    tl.store(chunk_counts_ptr + chunk * E_PAD + experts, counts)
    tl.atomic_add(totals_ptr + experts, counts)


@triton.jit(do_not_specialize=SIZE_ARGUMENTS)
def _align_chunk_kernel(ids_ptr, chunk_counts_ptr, totals_ptr, slots_ptr, block_experts_ptr,
                        num_blocks_ptr, num_slots, num_experts, padded_blocks,
                        BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr):
    """Expert ``e``'s slots of chunk ``c``, after its slots of the earlier chunks."""
    expert = tl.program_id(0)
    chunk = tl.program_id(1)
    earlier_counts = tl.zeros([CHUNK_VECTOR], tl.int32)  # [C]
    for base in range(0, chunk, CHUNK_VECTOR):
        earlier = base + tl.arange(0, CHUNK_VECTOR)  # [C]
        earlier_counts += tl.load(chunk_counts_ptr + earlier * E_PAD + expert,
                                  mask=earlier < chunk, other=0)
    position = chunk * CHUNK + tl.arange(0, CHUNK)  # [S]
    ids = _load_ids(ids_ptr, position, num_slots, E_PAD)
    totals = tl.load(totals_ptr + tl.arange(0, E_PAD))  # [E]
    _write_run(slots_ptr, block_experts_ptr, num_blocks_ptr, ids, position,
               tl.sum(earlier_counts, axis=0), totals, expert, num_slots, num_experts,
               padded_blocks, chunk == 0, BLOCK_M, E_PAD)


def moe_align_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> SortedSlots:
    """``moe_align`` (see ``qllm_kernels_moe.align``) with the same output on the blocks in use;
    ``topk_ids [T, k]`` contiguous."""
    ids = topk_ids.reshape(-1)
    num_slots = ids.numel()
    padded = max_padded_slots(num_slots, num_experts, block_m)
    device = topk_ids.device
    slots = torch.empty(padded, dtype=torch.int64, device=device)
    block_experts = torch.empty(padded // block_m, dtype=torch.int64, device=device)
    num_blocks = torch.empty(1, dtype=torch.int64, device=device)
    expert_pad = max(triton.next_power_of_2(num_experts + 1), MIN_VECTOR)
    if num_slots <= MAX_SLOTS:
        _align_kernel[(num_experts,)](
            ids, slots, block_experts, num_blocks, num_slots, num_experts, padded // block_m,
            BLOCK_M=block_m, E_PAD=expert_pad, num_warps=NUM_WARPS)
        return SortedSlots(slots, block_experts, num_blocks)
    chunks = triton.cdiv(num_slots, CHUNK)
    chunk_counts = torch.empty(chunks, expert_pad, dtype=torch.int32, device=device)
    totals = torch.zeros(expert_pad, dtype=torch.int32, device=device)
    _chunk_counts_kernel[(chunks,)](ids, chunk_counts, totals, num_slots, E_PAD=expert_pad,
                                    CHUNK=CHUNK, num_warps=NUM_WARPS)
    _align_chunk_kernel[(num_experts, chunks)](
        ids, chunk_counts, totals, slots, block_experts, num_blocks, num_slots, num_experts,
        padded // block_m, BLOCK_M=block_m, E_PAD=expert_pad, CHUNK=CHUNK, num_warps=NUM_WARPS)
    return SortedSlots(slots, block_experts, num_blocks)
