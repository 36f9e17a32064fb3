"""The small-batch MoE in one launch (opt-in: ``QLLM_MOE_SLOT=fused``).

The slot path (``triton_slot_moe``) runs a decode token's MoE as two kernels, ``gate_up`` then
``down``. At Qwen3.5-35B-A3B's batch 1 on the H200 they took 12.6 us (~3.0 TB/s) and 8.5 us
(~2.2 TB/s) with ~0.4 us between them: each is short enough to lose its ramp and its tail,
and ``down`` cannot start before the last ``gate_up`` program ends. Here both GEMVs are tasks
of one launch. With ``x [T, H]``, ``w13 [E, 2I, H]``, ``w2 [E, H, I]``, the shared expert's
``[2I, H]`` and ``[H, I]`` (expert id ``E``) and routing ``[T, k]`` (``S = T * k`` slots, slot
``t * k + j``):

- ``S * ceil(I / UP_ROWS)`` **gate/up tasks**, slot-major: ``UP_ROWS`` intermediate columns of
  one slot, ``silu(x[t] . gate) * (x[t] . up)`` over long contiguous rows of ``UP_BLOCK_K``,
  by ``_slot_gate_up_kernel``'s own loop (``_gate_up_rows``), stored (rounded to ``x.dtype``, as the two-kernel path
  does) into ``hidden [S, I]``; then the task adds 1 to its slot's ``ready`` counter (release).
- then ``S * ceil(H / DOWN_ROWS)`` **down tasks**: ``DOWN_ROWS`` output rows of one slot. A down
  task first loads its ``[DOWN_ROWS, I]`` tile of ``w2`` (the slot's expert, known from the
  routing alone) into registers, *then* waits until all of its slot's gate/up tasks have
  counted in (volatile polls, then one acquire), reads ``hidden``'s row (from L2), and stores
  ``weight * (w2 rows . hidden)`` rounded to ``x.dtype`` into ``out [S, H]``: the per-slot
  outputs of the ``fused_moe`` contract, unsummed, as the two-kernel path gives them.

Programs take their task from a ticket counter (``atomic_add``), not from ``program_id``: the
tickets are handed out in the order the programs start, so every task a down task waits for
was claimed by a program that is already running and never waits itself (gate/up tasks hold
the lower tickets). This is the forward-progress argument of decoupled look-back scans: no
deadlock whatever order the hardware schedules the programs in, however many programs fit on
the GPU at once. While the gate/up tasks stream ``w13``, the first down tasks stream their
``w2`` tiles, so the weight reads of the two GEMVs overlap; no task waits on a later one, and
there is no reduction at the end (each output row is one down task's), so the kernel's tail is
one task long.

**Deterministic.** Every value is computed by one program in a fixed order: the same
arithmetic as the two-kernel path (up to the order of ``tl.sum``'s reduction tree), bit-equal
from run to run, eager or CUDA-graph replay. The alternative split of the work over
(slot, intermediate slice), each program multiplying its slice of ``hidden`` straight into the
matching columns of ``w2`` (no ``hidden`` round trip), needs a sum over the slices per output
row: fp32 atomics (run-to-run differences in the last bits, a zeroed accumulator and a
conversion pass), or a partial buffer that the slot's last-arriving program reduces (one
program reading ``I / slice`` partial rows of ``H`` fp32: 128-256 KiB from L2 at the end of the
kernel, the tail this design avoids), and it reads ``w2`` in ``2 * slice``-byte pieces of 1 KiB
rows. ``hidden`` here is 9 KiB per token, written and read in L2.

**Counters.** ``counters [1 + 2 * S]`` int32: the ticket, then per slot ``ready`` (gate/up
tasks done) and ``consumed`` (down tasks past their wait). They are zero before a launch and
the launch leaves them zero: the program holding the last ticket resets the ticket, and the
last down task of each slot resets that slot's two counters. So a workspace per device is
zeroed once (``_counters``) and then reused by every call and every CUDA-graph replay with no
memset; launches that share it must not overlap, which holds on one stream (qllm runs a
device's steps on one; a capture that finds no workspace yet allocates a zeroed one for the
graph, a memset node more). No host sync anywhere: capturable.

Interpreter (``TRITON_INTERPRET=1``): the programs run one after another in ``program_id``
order, which is also ticket order, so every wait is already satisfied when it is reached.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from qllm_kernels_moe.configs import FusedSlotConfig
from qllm_kernels_moe.triton_slot_moe import _gate_up_rows

# QLLM_MOE_SLOT selects the small-batch path's kernels: "split" (default) two launches,
# gate_up then down (triton_slot_moe); "fused": this module's one launch. Read once, at import.
SLOT_MODES = ("split", "fused")


def slot_mode_from_env() -> str:
    """``QLLM_MOE_SLOT`` (default ``split``); an unknown value raises ``ValueError``."""
    mode = os.environ.get("QLLM_MOE_SLOT", "split").strip().lower() or "split"
    if mode not in SLOT_MODES:
        raise ValueError(f"QLLM_MOE_SLOT={mode!r}: expected one of {', '.join(SLOT_MODES)}")
    return mode


SLOT_MODE = slot_mode_from_env()


@triton.jit
def _gate_up_task(task, x_ptr, w13_ptr, shared_w13_ptr, ids_ptr, hidden_ptr, ready_ptrs,
                  num_experts, H, I, stride_x_row, stride_w13_expert, up_tasks,
                  TOP_K: tl.constexpr, UP_ROWS: tl.constexpr, UP_BLOCK_K: tl.constexpr):
    """``hidden[s, n]`` for ``UP_ROWS`` columns ``n`` of one slot ``s``, then the slot's
    ``ready`` counter plus one (release: the stores before it)."""
    slot = task // up_tasks
    expert = tl.load(ids_ptr + slot)
    w_ptr = tl.where(expert == num_experts, shared_w13_ptr, w13_ptr + expert * stride_w13_expert)
    rows = (task % up_tasks) * UP_ROWS + tl.arange(0, UP_ROWS)  # [UR]
    row_mask = rows < I
    ks = tl.arange(0, UP_BLOCK_K)
    gate_ptrs = w_ptr + rows[:, None] * H + ks[None, :]  # [UR, BK]
    x_ptrs = x_ptr + (slot // TOP_K) * stride_x_row + ks  # [BK]
    hidden = _gate_up_rows(x_ptrs, gate_ptrs, gate_ptrs + I * H, row_mask, ks, H, UP_ROWS,
                           UP_BLOCK_K)  # [UR]
    tl.store(hidden_ptr + slot * I + rows, hidden.to(hidden_ptr.dtype.element_ty),
             mask=row_mask)
    tl.debug_barrier()  # every thread's stores, before the release below
    tl.atomic_add(ready_ptrs + slot, 1, sem="release")


@triton.jit
def _down_task(task, w2_ptr, shared_w2_ptr, ids_ptr, routing_weights_ptr, hidden_ptr, out_ptr,
               ready_ptrs, consumed_ptrs, num_experts, H, I, stride_w2_expert, up_tasks,
               down_tasks, DOWN_ROWS: tl.constexpr, BLOCK_I: tl.constexpr):
    """``out[s, h]`` for ``DOWN_ROWS`` rows ``h`` of one slot ``s``: the ``w2`` tile loaded,
    then a wait for the slot's ``up_tasks`` gate/up tasks, then ``hidden``'s row; the slot's
    last down task zeroes its counters."""
    slot = task // down_tasks
    expert = tl.load(ids_ptr + slot)
    w_ptr = tl.where(expert == num_experts, shared_w2_ptr, w2_ptr + expert * stride_w2_expert)
    rows = (task % down_tasks) * DOWN_ROWS + tl.arange(0, DOWN_ROWS)  # [DR]
    row_mask = rows < H
    cols = tl.arange(0, BLOCK_I)
    col_mask = cols < I
    # the weights first: in flight while the slot's gate/up tasks finish
    w = tl.load(w_ptr + rows[:, None] * I + cols[None, :],
                mask=row_mask[:, None] & col_mask[None, :], other=0.0)  # [DR, BI]
    weight = tl.load(routing_weights_ptr + slot).to(tl.float32)
    # a barrier keeps ptxas from sinking the loads above below the polls (it does so across
    # volatile loads): they are issued first and waited for only where used
    tl.debug_barrier()
    ready = tl.load(ready_ptrs + slot, volatile=True)
    while ready < up_tasks:
        ready = tl.load(ready_ptrs + slot, volatile=True)
    # acquire the gate/up tasks' stores; the loads of hidden depend on its value (an acquire
    # whose value goes unused is dropped)
    ready = tl.atomic_add(ready_ptrs + slot, 0, sem="acquire")
    h = tl.load(hidden_ptr + slot * I + cols, mask=col_mask & (ready >= up_tasks), other=0.0,
                cache_modifier=".cg").to(tl.float32)  # [BI], from L2
    out = tl.sum(w.to(tl.float32) * h[None, :], axis=1) * weight
    tl.store(out_ptr + slot * H + rows, out.to(out_ptr.dtype.element_ty), mask=row_mask)
    tl.debug_barrier()
    if tl.atomic_add(consumed_ptrs + slot, 1, sem="relaxed") == down_tasks - 1:
        # the slot's last down task: all of them are past their wait
        tl.atomic_xchg(ready_ptrs + slot, 0, sem="relaxed")
        tl.atomic_xchg(consumed_ptrs + slot, 0, sem="relaxed")


@triton.jit
def _fused_slot_moe_kernel(
    x_ptr, w13_ptr, shared_w13_ptr, w2_ptr, shared_w2_ptr, ids_ptr, routing_weights_ptr,
    hidden_ptr, out_ptr, counters_ptr,
    num_slots, num_experts, H, I, stride_x_row, stride_w13_expert, stride_w2_expert,
    TOP_K: tl.constexpr, UP_ROWS: tl.constexpr, UP_BLOCK_K: tl.constexpr,
    DOWN_ROWS: tl.constexpr, BLOCK_I: tl.constexpr,
):
    """One task per program, by ticket: gate/up tasks ``[0, S * up_tasks)`` write
    ``hidden[s, n] = silu(x[t] . w13[e, n]) * (x[t] . w13[e, I + n])``, down tasks write
    ``out[s, h] = round(routing_weights[s] * (hidden[s] . w2[e, h]))`` once their slot's
    ``hidden`` row is complete. ``s = t * TOP_K + j``; expert ``num_experts`` is the shared
    expert's weights. Rows of the weights are contiguous (``H`` and ``I`` elements);
    ``BLOCK_I`` is ``I`` rounded up to a power of two (a down task's ``w2`` tile)."""
    up_tasks = tl.cdiv(I, UP_ROWS)  # per slot
    down_tasks = tl.cdiv(H, DOWN_ROWS)  # per slot
    num_up = num_slots * up_tasks
    ticket = tl.atomic_add(counters_ptr, 1, sem="relaxed")
    if ticket == num_up + num_slots * down_tasks - 1:  # every ticket is out: reset for next time
        tl.atomic_xchg(counters_ptr, 0, sem="relaxed")
    ready_ptrs = counters_ptr + 1  # [S]
    consumed_ptrs = counters_ptr + 1 + num_slots  # [S]
    if ticket < num_up:
        _gate_up_task(ticket, x_ptr, w13_ptr, shared_w13_ptr, ids_ptr, hidden_ptr, ready_ptrs,
                      num_experts, H, I, stride_x_row, stride_w13_expert, up_tasks,
                      TOP_K, UP_ROWS, UP_BLOCK_K)
    else:
        _down_task(ticket - num_up, w2_ptr, shared_w2_ptr, ids_ptr, routing_weights_ptr,
                   hidden_ptr, out_ptr, ready_ptrs, consumed_ptrs, num_experts, H, I,
                   stride_w2_expert, up_tasks, down_tasks, DOWN_ROWS, BLOCK_I)


# device -> zeroed int32 workspaces, never freed: a CUDA graph captured with one keeps its
# address, so a larger one is added beside it, never swapped in
_WORKSPACES: dict[torch.device, list[torch.Tensor]] = {}
MIN_COUNTERS = 1024


def _counters(device: torch.device, size: int) -> torch.Tensor:
    """A zeroed (and left zeroed by every launch) int32 workspace of at least ``size``."""
    for counters in _WORKSPACES.get(device, ()):
        if counters.numel() >= size:
            return counters
    counters = torch.zeros(max(size, MIN_COUNTERS), dtype=torch.int32, device=device)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        # zeroed by a memset node of this graph at every replay; not kept: its memory is the
        # graph pool's
        return counters
    _WORKSPACES.setdefault(device, []).append(counters)
    return counters


def fused_slot_args(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                    topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                    shared_w13: torch.Tensor, shared_w2: torch.Tensor, hidden: torch.Tensor,
                    out: torch.Tensor, counters: torch.Tensor,
                    config: FusedSlotConfig) -> tuple[tuple[int], dict]:
    """``(grid, arguments by name)`` of the kernel's launch (tensors may be on ``meta``:
    the offline sm_90 compile in ``testing`` takes the same arguments)."""
    num_slots = topk_ids.numel()
    num_experts, gate_up_rows, hidden_size = w13.shape
    inter = gate_up_rows // 2
    tasks = num_slots * (triton.cdiv(inter, config.UP_ROWS)
                         + triton.cdiv(hidden_size, config.DOWN_ROWS))
    args = dict(
        x_ptr=x, w13_ptr=w13, shared_w13_ptr=shared_w13, w2_ptr=w2, shared_w2_ptr=shared_w2,
        ids_ptr=topk_ids, routing_weights_ptr=topk_weights, hidden_ptr=hidden, out_ptr=out,
        counters_ptr=counters, num_slots=num_slots, num_experts=num_experts, H=hidden_size,
        I=inter, stride_x_row=x.stride(0), stride_w13_expert=w13.stride(0),
        stride_w2_expert=w2.stride(0), TOP_K=topk_ids.shape[1], UP_ROWS=config.UP_ROWS,
        UP_BLOCK_K=config.UP_BLOCK_K, DOWN_ROWS=config.DOWN_ROWS,
        BLOCK_I=triton.next_power_of_2(inter))
    return (tasks,), args


def slot_moe_fused(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                   topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                   shared_w13: torch.Tensor, shared_w2: torch.Tensor,
                   config: FusedSlotConfig | None = None) -> torch.Tensor:
    """The small-batch path in one launch: ``x [T, H]`` (unit column stride), ``w13 [E, 2I,
    H]``, ``w2 [E, H, I]``, the shared expert (id ``E``) ``shared_w13 [2I, H]`` and
    ``shared_w2 [H, I]`` (contiguous rows), ``topk_weights`` / ``topk_ids [T, k]``
    contiguous -> the per-slot outputs ``[T * k, H]`` in ``x.dtype`` (a token's slots
    adjacent), what ``slot_gate_up`` then ``slot_down`` give."""
    config = config or FusedSlotConfig()
    num_slots = topk_ids.numel()
    hidden = x.new_empty(num_slots, w13.shape[1] // 2)
    out = x.new_empty(num_slots, w13.shape[2])
    counters = _counters(x.device, 1 + 2 * num_slots)
    grid, args = fused_slot_args(x, w13, w2, topk_weights, topk_ids, shared_w13, shared_w2,
                                 hidden, out, counters, config)
    _fused_slot_moe_kernel[grid](**args, num_warps=config.num_warps,
                                 num_stages=config.num_stages)
    return out
