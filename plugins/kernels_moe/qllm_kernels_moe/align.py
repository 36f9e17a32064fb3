"""Token slots sorted by expert, in blocks of one expert each ("align" in vLLM / SGLang).

``topk_ids [T, k]`` routes ``S = T * k`` (token, slot) pairs; pair ``(t, j)`` is slot
``t * k + j``. ``moe_align`` lists the slots grouped by expert (stable: ascending slot ids
within an expert) and pads each expert's run with the sentinel ``S`` up to a multiple of
``block_m``, so that every ``block_m`` entries of the list belong to a single expert: one
program of a grouped GEMM serves one block against one expert's weights.

Only torch ops on the device, and every output size follows from the shapes alone (no host
sync), so the step can be captured in a CUDA graph.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class SortedSlots(NamedTuple):
    """The padded slot list and what each block of ``block_m`` entries holds."""

    slots: torch.Tensor          # [P] int64: slot ids grouped by expert; S marks padding
    #                              (in the used blocks; the Triton align leaves the rest unset)
    block_experts: torch.Tensor  # [P // block_m] int64: expert of each block (E past the used)
    num_blocks: torch.Tensor     # [1] int64: blocks in use; the later ones are all padding


def max_padded_slots(num_slots: int, num_experts: int, block_m: int) -> int:
    """``P``, the length of the padded list for any routing of ``num_slots`` slots.

    At most ``min(E, S)`` experts are hit and each gets at most ``block_m - 1`` padding
    entries; the used length is a whole number of blocks, so rounding down is safe.
    """
    bound = num_slots + min(num_experts, num_slots) * (block_m - 1)
    return bound // block_m * block_m


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> SortedSlots:
    """Sort the slots of ``topk_ids [T, k]`` (int32/int64 expert ids) by expert into blocks
    of ``block_m`` entries; see the module docstring."""
    num_slots = topk_ids.numel()
    padded = max_padded_slots(num_slots, num_experts, block_m)
    device = topk_ids.device
    sorted_experts, order = topk_ids.flatten().sort(stable=True)  # [S] each
    experts = torch.arange(num_experts + 1, device=device, dtype=sorted_experts.dtype)
    starts = torch.searchsorted(sorted_experts, experts)  # [E + 1]: first position of e; S
    blocks = (starts.diff() + (block_m - 1)) // block_m  # [E] blocks per expert
    block_ends = blocks.cumsum(0)  # [E]
    # padding inserted before expert e's run: its padded start minus its sorted start
    shift = (block_ends - blocks) * block_m - starts[:-1]  # [E]
    dest = torch.arange(num_slots, device=device) + shift[sorted_experts]  # [S]
    slots = torch.full((padded,), num_slots, dtype=order.dtype, device=device)
    slots[dest] = order
    block_starts = torch.arange(padded // block_m, device=device)
    block_experts = torch.searchsorted(block_ends, block_starts, right=True)  # [P // block_m]
    return SortedSlots(slots, block_experts, block_ends[-1:])
