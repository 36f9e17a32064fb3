"""``moe_align`` for decode-sized batches as one Triton program (one launch instead of the ~12
sort, search and scan kernels of the torch version; the same output, entry for entry).

One program walks the slots in chunks of ``CHUNK``. Each slot's expert becomes a one-hot row
over the (padded) experts, so per-expert counts are column sums, and a slot's rank among the
earlier slots of its expert is a running count plus an exclusive column cumsum within the
chunk: the order within an expert stays ascending, as in the stable sort. The work per chunk
is ``CHUNK x E`` element operations, so the kernel serves up to ``MAX_SLOTS`` slots; larger
(prefill) batches take the torch version.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qllm_kernels_moe.align import SortedSlots, max_padded_slots

MAX_SLOTS = 4096
# The fused op takes this kernel up to here (decode batches of up to 128 tokens at top-8),
# where one launch replaces ~12. Beyond it the sequential walk over chunks may lose to the
# torch sort's parallel kernels: not measured yet (bench_moe.py's ``tr_align`` column).
PREFERRED_UP_TO = 1024
CHUNK = 64


@triton.jit
def _align_kernel(ids_ptr, slots_ptr, block_experts_ptr, num_blocks_ptr,
                  num_slots, num_experts, padded,
                  BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr,
                  BLOCKS_CHUNK: tl.constexpr):
    experts = tl.arange(0, E_PAD)  # [E]
    rows = tl.arange(0, CHUNK)  # [C]

    # 1. slots per expert
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    for start in range(0, num_slots, CHUNK):
        ids = tl.load(ids_ptr + start + rows, mask=start + rows < num_slots, other=-1)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)

    # 2. padded runs: expert e owns blocks [ends[e] - blocks[e], ends[e])
    blocks = (counts + BLOCK_M - 1) // BLOCK_M  # [E]
    ends = tl.cumsum(blocks, axis=0)  # [E]
    run_starts = (ends - blocks) * BLOCK_M  # [E] first entry of each expert's run
    tl.store(num_blocks_ptr, tl.sum(blocks, axis=0).to(tl.int64))
    for first in range(0, padded // BLOCK_M, BLOCKS_CHUNK):
        block = first + tl.arange(0, BLOCKS_CHUNK)  # [B]
        owner = tl.sum((ends[None, :] <= block[:, None]).to(tl.int32), axis=1)  # [B]
        tl.store(block_experts_ptr + block, tl.minimum(owner, num_experts).to(tl.int64),
                 mask=block < padded // BLOCK_M)

    # 3. every entry starts as padding (the sentinel num_slots) ...
    for first in range(0, padded, CHUNK):
        tl.store(slots_ptr + first + rows, tl.full([CHUNK], 0, tl.int64) + num_slots,
                 mask=first + rows < padded)
    tl.debug_barrier()

    # 4. ... then each slot goes to its run start plus its rank within its expert
    seen = tl.zeros([E_PAD], dtype=tl.int32)  # slots of each expert in earlier chunks
    for start in range(0, num_slots, CHUNK):
        slot = start + rows
        ids = tl.load(ids_ptr + slot, mask=slot < num_slots, other=-1)
        onehot = (ids[:, None] == experts[None, :]).to(tl.int32)  # [C, E]
        before = tl.cumsum(onehot, axis=0) - onehot + seen[None, :]  # [C, E]
        dest = tl.sum(onehot * (run_starts[None, :] + before), axis=1)  # [C]
        tl.store(slots_ptr + dest, slot.to(tl.int64), mask=slot < num_slots)
        seen += tl.sum(onehot, axis=0)


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
    _align_kernel[(1,)](
        topk_ids.reshape(-1), slots, block_experts, num_blocks, num_slots, num_experts, padded,
        BLOCK_M=block_m, E_PAD=triton.next_power_of_2(num_experts), CHUNK=CHUNK,
        BLOCKS_CHUNK=64, num_warps=4)
    return SortedSlots(slots, block_experts, num_blocks)
