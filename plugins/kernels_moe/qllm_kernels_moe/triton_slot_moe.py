"""Fused MoE for a handful of tokens: one program per slot, no sort.

At decode batch 1 the sorted path's blocks hold one slot each: its sort and the padding of
every block to ``BLOCK_M`` rows cost more than they save. Here (a table
entry with ``BLOCK_M == 1``) with ``x [T, H]``, ``topk_ids [T, k]`` (``S = T * k`` slots, slot
``t * k + j``; expert ``E`` is the shared expert's weights):

1. ``gate_up``: one program per tile (slot, ``BLOCK_N`` intermediate columns) reads its token's
   row of ``x`` and ``BLOCK_N`` gate and up rows of the slot's expert, long contiguous rows of
   ``BLOCK_K``, and stores ``silu(gate) * up`` -> ``hidden [S, I]``. With the config's
   ``programs_per_sm``, fewer programs each compute every so many tiles, reading a tile's
   weights while the one before is reduced (on an H100, W3 at 6 or 8 per SM: 392.2-392.8 tok/s
   against 389.2 one program a tile, one run each; 2 per SM: 362-366. Not in the table: the
   down, which this was to let launch while the gate-up streams, still started 4 us before the
   gate-up's end, as with one program a tile; results.jsonl, 2026-12-07).
2. ``down``: one program per (slot, ``BLOCK_N`` output columns): ``hidden``'s row through the
   slot's ``w2`` rows, times the routing weight, rounded to ``x.dtype`` -> ``expert_out [S, H]``,
   the per-slot outputs, summed by the residual add after the block. (One program per token
   running its k slots in turn, with the sum in the same kernel, waited on nine loads one
   after the other: 10.7 us per layer at W3's one token, 1.65 TB/s.)

Or, with the config's ``persistent_programs_per_sm``, both in one persistent kernel
(``slot_moe``): every program resident at once, each takes gate-up tiles, then down tiles, in
one round-robin; a down tile reads its weights, then waits for its slot's gate-up tiles (a
counter per slot, release / acquire atomics), so the down's weights stream while the gate-up's
last tiles run. Two kernels cannot do that: the down's programs launch only once every
gate-up program has released them (at one token, 4,608 one-column programs in about three
waves: the last wave's release comes late) and find the multiprocessors full until the
gate-up's programs exit; ``benchmarks/bench_pdl_launch.py`` measured the release itself
working (a dependent entered 0.35-0.48 us after the last release, 2026-12-07, H100).

Or, with the config's ``prefetch_down`` (two kernels), each gate-up tile, once its own weights
are asked for, asks the L2 cache (evict-last) for its share of its slot's down weights
(``_prefetch_down_rows``: ``prefetch.global.L2``, a CCTL in the SASS, no register held, nothing
waiting for it), so that the down reads from L2. The bet: the gate-up leaves the memory bus
idle part of the time (W3 on an H100: 15.0 us a layer for 11.3 us of weight reads), and the down
then ends soon after it (8.4 us a layer for 5.6 us of reads). Not measured yet.

An expert hit by several slots is read once per slot (from L2 after the first), so the path
pays only while slots rarely share experts: the tuner decides up to which token count.
Products are accumulated over ``[BLOCK_N, BLOCK_K]`` tiles in fp32 and reduced once per row at
the end; a tile covering all of K is reduced at once, which halves the registers (the one-token
entry's: gate-up 40 instead of 72, down 63 instead of 127), so more programs are resident, their
tiles read, when the wait ends. No host syncs: capturable in a CUDA graph. In small decode steps
(``qllm.plugins.pdl``) both kernels are launched with programmatic dependent launch. The gate-up
waits for the router (``qllm.plugins.pdl.pdl_wait``) before reading the expert ids, and lets the
down launch only after that wait: so when the down starts, the router has completed, and the
down reads its ids and its whole first weight tile before its own wait (for the gate-up's
``hidden``); with a tile covering all of K (the one-token entry's), the down's weights stream
while the gate-up's last programs run. Only a token's last slot, the shared expert's by the
router's convention (``moe_router``), knows its weights before the router ends: the gate-up's
programs for it read the shared expert's first ``BLOCK_K`` columns before the wait and keep them
where the id confirms the guess (elsewhere, e.g. ids without the shared expert, the guess costs
their bandwidth, not their result).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qllm.plugins.devices import multiprocessors, resident_programs_per_sm
from qllm.plugins.pdl import pdl_arguments, pdl_release, pdl_wait
from qllm_kernels_moe.configs import GemmConfig, MoeConfig


@triton.jit
def _expert_rows(w_ptr, shared_w_ptr, expert, num_experts, stride_w_expert, offsets):
    """Pointers to ``offsets`` in expert ``expert``'s weights (``num_experts``: the shared
    expert's, ``shared_w``)."""
    shared = expert == num_experts
    return tl.where(shared, shared_w_ptr, w_ptr + expert * stride_w_expert) + offsets


@triton.jit
def _weight_tiles(w_ptr, shared_w_ptr, expert, first_row, num_experts, N, K, stride_w_expert,
                  stride_w_row, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  GATED: tl.constexpr):
    """Rows ``first_row ...`` (``BLOCK_N``) of expert ``expert``'s weights (the shared
    expert's for id ``num_experts``), their first ``BLOCK_K`` columns loaded -> ``(rows [BN],
    row_mask [BN], w_ptrs [BN, BK] at the first tile, tile [BN, BK], up_tile [BN, BK])``; with
    ``GATED`` the tiles are the gate rows and the up rows ``N`` further down, else ``up_tile``
    is ``tile``."""
    rows = first_row + tl.arange(0, BLOCK_N)  # [BN]
    row_mask = rows < N
    ks = tl.arange(0, BLOCK_K)
    first = row_mask[:, None] & (ks < K)[None, :]  # [BN, BK]
    w_ptrs = _expert_rows(w_ptr, shared_w_ptr, expert, num_experts, stride_w_expert,
                          rows[:, None] * stride_w_row + ks[None, :])
    tile = tl.load(w_ptrs, mask=first, other=0.0)
    up_tile = tile
    if GATED:
        up_tile = tl.load(w_ptrs + N * stride_w_row, mask=first, other=0.0)
    return rows, row_mask, w_ptrs, tile, up_tile


@triton.jit
def _first_weight_tiles(w_ptr, shared_w_ptr, ids_ptr, slot, first_row, num_experts, N, K,
                        stride_w_expert, stride_w_row, TOP_K: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GATED: tl.constexpr,
                        IDS_BEFORE_WAIT: tl.constexpr, USE_PDL: tl.constexpr):
    """A program's first tile, ``_weight_tiles`` of ``slot``'s expert, loaded around the PDL
    wait (module docstring). With ``IDS_BEFORE_WAIT`` (the down: the kernel before it let it
    launch only once the router had completed) the id and the tiles are read before the wait,
    the id past the L1 cache. Without (the gate-up, right after the router): a token's last
    slot reads the shared weights' tile before the wait, kept where its id confirms the guess,
    every other tile after it, and the next kernel may launch only after the wait. Returns
    ``(rows, row_mask, ks [BK], w_ptrs, tile, up_tile)`` as ``_weight_tiles``, then the slot's
    expert id."""
    ks = tl.arange(0, BLOCK_K)
    if IDS_BEFORE_WAIT:
        pdl_release(USE_PDL)
        expert = tl.load(ids_ptr + slot, cache_modifier=".cg")
        rows, row_mask, w_ptrs, tile, up_tile = _weight_tiles(
            w_ptr, shared_w_ptr, expert, first_row, num_experts, N, K, stride_w_expert,
            stride_w_row, BLOCK_N, BLOCK_K, GATED)
        pdl_wait(USE_PDL)
    else:
        rows = first_row + tl.arange(0, BLOCK_N)  # [BN]
        row_mask = rows < N
        first = row_mask[:, None] & (ks < K)[None, :]  # [BN, BK]
        offsets = rows[:, None] * stride_w_row + ks[None, :]  # [BN, BK]
        guess = slot % TOP_K == TOP_K - 1
        early = tl.load(shared_w_ptr + offsets, mask=first & guess, other=0.0)
        if GATED:
            early_up = tl.load(shared_w_ptr + N * stride_w_row + offsets, mask=first & guess,
                               other=0.0)
        pdl_wait(USE_PDL)  # the ids are the router's output
        pdl_release(USE_PDL)  # after the wait: the next kernel reads the ids before its own
        expert = tl.load(ids_ptr + slot)
        w_ptrs = _expert_rows(w_ptr, shared_w_ptr, expert, num_experts, stride_w_expert,
                              offsets)
        late = first & ~(guess & (expert == num_experts))
        tile = tl.load(w_ptrs, mask=late, other=early)
        up_tile = tile
        if GATED:
            up_tile = tl.load(w_ptrs + N * stride_w_row, mask=late, other=early_up)
    return rows, row_mask, ks, w_ptrs, tile, up_tile, expert


@triton.jit
def _slot_tile(tile, tokens, num_blocks, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr,
               LOOPED: tl.constexpr):
    """Tile ``tile`` of a GEMM over the slots -> ``(slot, first row)``. One tile a program: the
    slots vary fastest (every program reads its first tile, the shared expert's guessed before
    the wait). ``LOOPED``: the tiles of every token's last slot (the shared expert's) come
    first, then the slots before it, a slot's tiles together (so the persistent kernel's
    gate-up completes the slots in the order its down takes them)."""
    if LOOPED:
        order, block = tile // num_blocks, tile % num_blocks
        slot = (order % tokens) * TOP_K + TOP_K - 1 - order // tokens
    else:
        slot, block = tile % (tokens * TOP_K), tile // (tokens * TOP_K)
    return slot, block * BLOCK_N


@triton.jit
def _gate_up_rows(x_ptr, hidden_ptr, slot, rows, row_mask, ks, gate_ptrs, gate_w, up_w, N, K,
                  stride_x_row, stride_w_row, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr,
                  WHOLE_K: tl.constexpr):
    """``hidden[slot, rows] = silu(x[t] . gate rows) * (x[t] . up rows)`` for the slot's token
    ``t``, from the rows' first ``BLOCK_K`` columns already loaded (``gate_w``, ``up_w``
    ``[BN, BK]``, ``gate_ptrs`` at them) and the rest read here."""
    x_ptrs = x_ptr + (slot // TOP_K) * stride_x_row + ks  # [BK]
    up_ptrs = gate_ptrs + N * stride_w_row
    x = tl.load(x_ptrs, mask=ks < K, other=0.0).to(tl.float32)[None, :]  # [1, BK]
    if WHOLE_K:  # reduced at once, without [BN, BK] fp32 accumulators (as in the down)
        gate_sum = tl.sum(gate_w.to(tl.float32) * x, axis=1)  # [BN]
        up_sum = tl.sum(up_w.to(tl.float32) * x, axis=1)
    else:
        gate = gate_w.to(tl.float32) * x  # [BN, BK]
        up = up_w.to(tl.float32) * x
        for k_start in range(BLOCK_K, K, BLOCK_K):
            x_ptrs += BLOCK_K
            gate_ptrs += BLOCK_K
            up_ptrs += BLOCK_K
            k_mask = ks < K - k_start
            x = tl.load(x_ptrs, mask=k_mask, other=0.0).to(tl.float32)[None, :]  # [1, BK]
            w_mask = row_mask[:, None] & k_mask[None, :]
            gate += tl.load(gate_ptrs, mask=w_mask, other=0.0).to(tl.float32) * x
            up += tl.load(up_ptrs, mask=w_mask, other=0.0).to(tl.float32) * x
        gate_sum = tl.sum(gate, axis=1)  # [BN]
        up_sum = tl.sum(up, axis=1)
    out = gate_sum * tl.sigmoid(gate_sum) * up_sum
    tl.store(hidden_ptr + slot * N + rows, out.to(hidden_ptr.dtype.element_ty), mask=row_mask)


@triton.jit
def _publish(counters_ptr, slot, PERSISTENT: tl.constexpr):
    """In the persistent kernel, after a gate-up tile's store: count it done for ``slot``,
    every thread's store of it ordered before (the down's tiles of the slot wait on the
    count, ``_await_slot``)."""
    if PERSISTENT:
        tl.debug_barrier()
        tl.atomic_add(counters_ptr + slot, 1, sem="release")


@triton.jit
def _await_slot(counters_ptr, slot, tiles):
    """Spin until ``tiles`` gate-up tiles of ``slot`` are counted done; the loads after it see
    their stores (an acquire: on sm_90 strong loads, then the L1 cache invalidated)."""
    while tl.atomic_add(counters_ptr + slot, 0, sem="acquire") < tiles:
        pass


L2_LINE_BYTES = 128  # what one L2 prefetch asks for: the line that holds its address


@triton.jit
def _prefetch_down_rows(w2_ptr, shared_w2_ptr, expert, block, num_blocks, num_experts, H, I,
                        stride_w2_expert, LINE_ELEMS: tl.constexpr, LINES: tl.constexpr):
    """Ask the L2 cache (evict-last) for gate-up tile ``block``'s share of the down weights of
    its slot's expert ``expert``: rows ``block * ceil(H / num_blocks) ...`` of its ``w2 [H, I]`` (rows
    contiguous, ``LINE_ELEMS`` elements a line, ``LINES`` lines cover a share), so that the
    down reads them from L2. Nothing waits for the lines and no register holds them: the reads
    fill the memory bus where the gate-up leaves it idle, without taking a program's place."""
    rows_per_block = tl.cdiv(H, num_blocks)
    first_row = block * rows_per_block
    span = (tl.minimum(first_row + rows_per_block, H) - first_row) * I  # elements
    offsets = tl.minimum(tl.arange(0, LINES) * LINE_ELEMS, tl.maximum(span - 1, 0))  # [LINES]
    ptrs = _expert_rows(w2_ptr, shared_w2_ptr, expert, num_experts, stride_w2_expert,
                        first_row * I + offsets)
    tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;",
                              "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _gate_up_tiles(x_ptr, w_ptr, shared_w_ptr, ids_ptr, hidden_ptr, counters_ptr, num_experts,
                   tokens, N, K, stride_x_row, stride_w_expert, stride_w_row,
                   TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   WHOLE_K: tl.constexpr, LOOPED: tl.constexpr, PERSISTENT: tl.constexpr,
                   USE_PDL: tl.constexpr, w2_ptr, shared_w2_ptr, H, stride_w2_expert,
                   PREFETCH_LINES: tl.constexpr, LINE_ELEMS: tl.constexpr):
    """This program's gate-up tiles: tile ``p`` (``_slot_tile``) and, with ``LOOPED`` (fewer
    programs than tiles, ``G`` of them), tiles ``p + G, p + 2G, ...``, each tile's weights
    read while the tile before it is reduced; ``PERSISTENT``: each tile counted done
    (``_publish``); ``PREFETCH_LINES``: with each tile, once its weights are asked for, its
    share of the down's asked of L2 (``_prefetch_down_rows``; ``w2``, ``shared_w2``
    ``[.., H, N]``)."""
    num_blocks = tl.cdiv(N, BLOCK_N)
    num_tiles = tokens * TOP_K * num_blocks
    slot, first_row = _slot_tile(tl.program_id(0), tokens, num_blocks, TOP_K, BLOCK_N, LOOPED)
    rows, row_mask, ks, gate_ptrs, gate_w, up_w, expert = _first_weight_tiles(
        w_ptr, shared_w_ptr, ids_ptr, slot, first_row, num_experts, N, K, stride_w_expert,
        stride_w_row, TOP_K, BLOCK_N, BLOCK_K, GATED=True, IDS_BEFORE_WAIT=False,
        USE_PDL=USE_PDL)  # gate_ptrs, gate_w, up_w: [BN, BK]; x: the norm's
    if LOOPED:  # compiled out where each program has one tile (half the registers)
        for tile in range(tl.program_id(0) + tl.num_programs(0), num_tiles, tl.num_programs(0)):
            next_slot, next_row = _slot_tile(tile, tokens, num_blocks, TOP_K, BLOCK_N, LOOPED)
            next_expert = tl.load(ids_ptr + next_slot)
            next_rows, next_mask, next_ptrs, next_gate_w, next_up_w = _weight_tiles(
                w_ptr, shared_w_ptr, next_expert, next_row, num_experts, N, K, stride_w_expert,
                stride_w_row, BLOCK_N, BLOCK_K, GATED=True)
            if PREFETCH_LINES:
                _prefetch_down_rows(w2_ptr, shared_w2_ptr, expert, first_row // BLOCK_N,
                                    num_blocks, num_experts, H, N, stride_w2_expert,
                                    LINE_ELEMS, PREFETCH_LINES)
            _gate_up_rows(x_ptr, hidden_ptr, slot, rows, row_mask, ks, gate_ptrs, gate_w, up_w, N,
                          K, stride_x_row, stride_w_row, TOP_K, BLOCK_K, WHOLE_K)
            _publish(counters_ptr, slot, PERSISTENT)
            slot, expert, first_row, rows, row_mask, gate_ptrs, gate_w, up_w = (
                next_slot, next_expert, next_row, next_rows, next_mask, next_ptrs, next_gate_w,
                next_up_w)
    if PREFETCH_LINES:  # issued behind the tile's own reads, before its reduction (with
        # the reduction's registers free: 40 a thread, as without, on the one-token entry)
        _prefetch_down_rows(w2_ptr, shared_w2_ptr, expert, first_row // BLOCK_N,
                            num_blocks, num_experts, H, N, stride_w2_expert, LINE_ELEMS,
                            PREFETCH_LINES)
    _gate_up_rows(x_ptr, hidden_ptr, slot, rows, row_mask, ks, gate_ptrs, gate_w, up_w, N, K,
                  stride_x_row, stride_w_row, TOP_K, BLOCK_K, WHOLE_K)
    _publish(counters_ptr, slot, PERSISTENT)


@triton.jit
def _slot_gate_up_kernel(x_ptr, w_ptr, shared_w_ptr, ids_ptr, hidden_ptr, w2_ptr, shared_w2_ptr,
                         num_experts, tokens, N, K, H, stride_x_row, stride_w_expert,
                         stride_w_row, stride_w2_expert, TOP_K: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WHOLE_K: tl.constexpr,
                         LOOPED: tl.constexpr, PREFETCH_LINES: tl.constexpr,
                         LINE_ELEMS: tl.constexpr, USE_PDL: tl.constexpr):
    """``hidden[s, n] = silu(x[t] . w[e, n]) * (x[t] . w[e, N + n])`` for slot ``s`` of token
    ``t = s // TOP_K`` routed to expert ``e`` (``num_experts``: ``shared_w``), over the tiles
    of ``_gate_up_tiles``. ``WHOLE_K``: ``BLOCK_K >= K``, the first tiles are the whole
    rows. ``PREFETCH_LINES``: each tile then asks L2 for its share of the down's weights
    (``w2``, ``shared_w2``; else unread)."""
    _gate_up_tiles(x_ptr, w_ptr, shared_w_ptr, ids_ptr, hidden_ptr, None, num_experts, tokens,
                   N, K, stride_x_row, stride_w_expert, stride_w_row, TOP_K, BLOCK_N, BLOCK_K,
                   WHOLE_K, LOOPED, False, USE_PDL, w2_ptr, shared_w2_ptr, H,
                   stride_w2_expert, PREFETCH_LINES, LINE_ELEMS)  # no counters


@triton.jit
def _down_rows(hidden_ptr, routing_weights_ptr, out_ptr, slot, rows, row_mask, ks, w_ptrs, w,
               N, K, BLOCK_K: tl.constexpr, WHOLE_K: tl.constexpr):
    """``out[slot, rows] = round(routing_weights[slot] * (hidden[slot] . w rows))`` from the
    rows' first ``BLOCK_K`` columns already loaded (``w [BN, BK]``, ``w_ptrs`` at them), the
    rest read here."""
    h_ptrs = hidden_ptr + slot * K + ks  # [BK]
    h = tl.load(h_ptrs, mask=ks < K, other=0.0).to(tl.float32)[None, :]  # [1, BK]
    if WHOLE_K:  # reduced at once: no [BN, BK] fp32 accumulator (half the registers), so
        # twice the programs hold their tile, read before the wait, at a time
        dots = tl.sum(w.to(tl.float32) * h, axis=1)  # [BN]
    else:
        acc = w.to(tl.float32) * h  # [BN, BK]
        for k_start in range(BLOCK_K, K, BLOCK_K):
            h_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
            k_mask = ks < K - k_start
            h = tl.load(h_ptrs, mask=k_mask, other=0.0).to(tl.float32)[None, :]  # [1, BK]
            w = tl.load(w_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            acc += w.to(tl.float32) * h
        dots = tl.sum(acc, axis=1)
    out = dots * tl.load(routing_weights_ptr + slot).to(tl.float32)
    tl.store(out_ptr + slot * N + rows, out.to(out_ptr.dtype.element_ty), mask=row_mask)


@triton.jit
def _slot_down_kernel(hidden_ptr, w_ptr, shared_w_ptr, ids_ptr, routing_weights_ptr, out_ptr,
                      num_experts, N, K, stride_w_expert, stride_w_row,
                      TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      WHOLE_K: tl.constexpr, USE_PDL: tl.constexpr):
    """``out[s, n] = round(routing_weights[s] * (hidden[s] . w[e, n]))`` for slot ``s`` routed
    to expert ``e`` (``num_experts``: ``shared_w``); ``round`` to ``out``'s dtype. ``WHOLE_K``:
    ``BLOCK_K >= K``, the first tile is the whole row."""
    slot = tl.program_id(0)
    rows, row_mask, ks, w_ptrs, w, _, _ = _first_weight_tiles(
        w_ptr, shared_w_ptr, ids_ptr, slot, tl.program_id(1) * BLOCK_N, num_experts, N, K,
        stride_w_expert, stride_w_row, TOP_K, BLOCK_N, BLOCK_K, GATED=False,
        IDS_BEFORE_WAIT=True, USE_PDL=USE_PDL)  # w_ptrs, w: [BN, BK]; hidden: the gate-up's
    _down_rows(hidden_ptr, routing_weights_ptr, out_ptr, slot, rows, row_mask, ks, w_ptrs, w,
               N, K, BLOCK_K, WHOLE_K)


RESET_BLOCK = tl.constexpr(128)  # counters the persistent kernel zeroes per store


@triton.jit
def _slot_moe_kernel(x_ptr, w13_ptr, shared_w13_ptr, w2_ptr, shared_w2_ptr, ids_ptr,
                     routing_weights_ptr, hidden_ptr, out_ptr, counters_ptr, num_experts, tokens,
                     I, H, stride_x_row, stride_w13_expert, stride_w13_row, stride_w2_expert,
                     stride_w2_row, TOP_K: tl.constexpr, UP_BLOCK_N: tl.constexpr,
                     UP_BLOCK_K: tl.constexpr, UP_WHOLE_K: tl.constexpr,
                     DOWN_BLOCK_N: tl.constexpr, DOWN_BLOCK_K: tl.constexpr,
                     DOWN_WHOLE_K: tl.constexpr, USE_PDL: tl.constexpr):
    """Both GEMMs in one persistent grid of ``G`` programs, every one resident at once (the
    launcher's bound): the gate-up's tiles (``_gate_up_tiles``, looped), then the down's, the
    tiles of both numbered as one round-robin sequence, so a program that runs out of gate-up
    tiles starts on the down's at once. A down tile reads its weights, then waits for its
    slot's gate-up tiles (``counters[slot]``), then reads the slot's ``hidden`` row. The last
    program to finish zeroes ``counters[:S + 1]`` (``counters[S]`` counts the programs done),
    so every launch finds them zero."""
    _gate_up_tiles(x_ptr, w13_ptr, shared_w13_ptr, ids_ptr, hidden_ptr, counters_ptr,
                   num_experts, tokens, I, H, stride_x_row, stride_w13_expert, stride_w13_row,
                   TOP_K, UP_BLOCK_N, UP_BLOCK_K, UP_WHOLE_K, True, True, USE_PDL,
                   None, None, 0, 0, 0, 0)  # looped, persistent, no prefetch
    programs = tl.num_programs(0)
    num_slots = tokens * TOP_K
    up_blocks = tl.cdiv(I, UP_BLOCK_N)
    down_blocks = tl.cdiv(H, DOWN_BLOCK_N)
    ks = tl.arange(0, DOWN_BLOCK_K)
    first_down = (tl.program_id(0) + programs - num_slots * up_blocks % programs) % programs
    for tile in range(first_down, num_slots * down_blocks, programs):
        slot, first_row = _slot_tile(tile, tokens, down_blocks, TOP_K, DOWN_BLOCK_N,
                                     LOOPED=True)
        rows, row_mask, w_ptrs, w, _ = _weight_tiles(
            w2_ptr, shared_w2_ptr, tl.load(ids_ptr + slot), first_row, num_experts, H, I,
            stride_w2_expert, stride_w2_row, DOWN_BLOCK_N, DOWN_BLOCK_K,
            GATED=False)  # w_ptrs, w: [BN, BK]
        _await_slot(counters_ptr, slot, up_blocks)
        _down_rows(hidden_ptr, routing_weights_ptr, out_ptr, slot, rows, row_mask, ks, w_ptrs,
                   w, H, I, DOWN_BLOCK_K, DOWN_WHOLE_K)
    done = tl.atomic_add(counters_ptr + num_slots, 1, sem="acq_rel")
    if done == programs - 1:
        for first in range(0, num_slots + 1, RESET_BLOCK):
            entries = first + tl.arange(0, RESET_BLOCK)
            tl.store(counters_ptr + entries, tl.zeros([RESET_BLOCK], tl.int32),
                     mask=entries <= num_slots)


def slot_gate_up(x: torch.Tensor, w13: torch.Tensor, shared_w13: torch.Tensor,
                 topk_ids: torch.Tensor, config: GemmConfig,
                 prefetch_down: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """GEMM 1 per slot: ``x [T, H]`` through each slot's expert of ``w13 [E, 2I, H]`` (expert
    ``E``: ``shared_w13 [2I, H]``), ``topk_ids [T, k]`` contiguous -> ``silu(gate) * up`` as
    ``hidden [T * k, I]``. One program per tile, or ``config.programs_per_sm`` per
    multiprocessor where that is fewer. ``prefetch_down``: the down's ``(w2 [E, H, I],
    shared_w2 [H, I])``, rows contiguous; each tile then asks L2 for its share of them
    (``_prefetch_down_rows``; compiled only for GPUs, never under the interpreter)."""
    tokens, top_k = topk_ids.shape
    inter = w13.shape[1] // 2
    hidden = x.new_empty(tokens * top_k, inter)
    num_blocks = triton.cdiv(inter, config.BLOCK_N)
    tiles = tokens * top_k * num_blocks
    programs = tiles
    if config.programs_per_sm:
        programs = min(tiles, config.programs_per_sm * multiprocessors(x.device))
    w2, shared_w2 = prefetch_down or (None, None)
    line_elems = L2_LINE_BYTES // x.element_size()
    lines = 0
    if w2 is not None:
        share = triton.cdiv(w2.shape[1], num_blocks) * inter  # elements a tile asks for
        lines = triton.next_power_of_2(triton.cdiv(share, line_elems))
    _slot_gate_up_kernel[(programs,)](
        x, w13, shared_w13, topk_ids, hidden, w2, shared_w2, w13.shape[0], tokens, inter,
        x.shape[1], 0 if w2 is None else w2.shape[1], x.stride(0), w13.stride(0),
        w13.stride(1), 0 if w2 is None else w2.stride(0), TOP_K=top_k,
        BLOCK_N=config.BLOCK_N, BLOCK_K=config.BLOCK_K, WHOLE_K=config.BLOCK_K >= x.shape[1],
        LOOPED=programs < tiles, PREFETCH_LINES=lines, LINE_ELEMS=line_elems,
        num_warps=config.num_warps, num_stages=config.num_stages,
        **pdl_arguments(x.device, tokens))
    return hidden


def slot_down(hidden: torch.Tensor, w2: torch.Tensor, shared_w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              config: GemmConfig) -> torch.Tensor:
    """GEMM 2 per slot: ``hidden [T * k, I]`` (contiguous) through each slot's expert of
    ``w2 [E, H, I]`` (expert ``E``: ``shared_w2 [H, I]``), times ``topk_weights [T, k]`` ->
    ``expert_out [T * k, H]`` in ``hidden.dtype``, a token's slots adjacent."""
    num_slots, inter = hidden.shape
    hidden_size = w2.shape[1]
    out = hidden.new_empty(num_slots, hidden_size)
    grid = (num_slots, triton.cdiv(hidden_size, config.BLOCK_N))
    _slot_down_kernel[grid](
        hidden, w2, shared_w2, topk_ids, topk_weights, out, w2.shape[0], hidden_size, inter,
        w2.stride(0), w2.stride(1), TOP_K=topk_ids.shape[1], BLOCK_N=config.BLOCK_N,
        BLOCK_K=config.BLOCK_K, WHOLE_K=config.BLOCK_K >= inter, num_warps=config.num_warps,
        num_stages=config.num_stages, **pdl_arguments(hidden.device, topk_ids.shape[0]))
    return out


# device -> every counters buffer made there, the current one last: a grown buffer's
# predecessor stays alive, since CUDA graphs captured before the growth keep its address
_counters: dict[torch.device, list[torch.Tensor]] = {}
_resident: dict[tuple, int] = {}  # launch key -> programs one multiprocessor holds


def _slot_counters(device: torch.device, num_slots: int) -> torch.Tensor:
    """The persistent kernel's counters on ``device``, int32, at least ``num_slots + 1`` (one
    per slot, then the programs done): zero between launches (each launch's last program
    zeroes them), grown (doubled) outside CUDA graph captures only."""
    buffers = _counters.setdefault(device, [])
    if not buffers or buffers[-1].numel() <= num_slots:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"the persistent slot MoE needs counters for {num_slots} slots "
                               f"before this CUDA graph capture: run the op at this token "
                               f"count once outside it first")
        size = max(256, 2 * (num_slots + 1))
        buffers.append(torch.zeros(size, dtype=torch.int32, device=device))
    return buffers[-1]


def _persistent_programs(launch_key: tuple, device: torch.device, per_sm: int, args: tuple,
                         kwargs: dict) -> int:
    """Programs of the persistent kernel: ``per_sm`` per multiprocessor, bounded by how many
    are resident at once (its programs wait for each other: more would deadlock); one on the
    CPU, whose interpreter runs programs one after another. The bound assumes the process has
    every multiprocessor (not an MPS client held to a share of them)."""
    if device.type != "cuda":
        return 1
    if launch_key not in _resident:
        compiled = _slot_moe_kernel.warmup(*args, grid=(1,), **kwargs)
        _resident[launch_key] = resident_programs_per_sm(compiled, device)
    return min(per_sm, _resident[launch_key]) * multiprocessors(device)


def slot_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, shared_w13: torch.Tensor,
             shared_w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
             config: MoeConfig) -> torch.Tensor:
    """Both GEMMs per slot in one persistent kernel (``_slot_moe_kernel``): ``x [T, H]``,
    ``w13 [E, 2I, H]``, ``w2 [E, H, I]`` (expert ``E``: ``shared_w13``, ``shared_w2``),
    ``topk_weights`` / ``topk_ids [T, k]`` contiguous -> ``expert_out [T * k, H]`` as
    ``slot_down``'s, with ``config.persistent_programs_per_sm`` programs per multiprocessor at
    most."""
    tokens, top_k = topk_ids.shape
    num_slots, inter, hidden_size = tokens * top_k, w2.shape[2], x.shape[1]
    hidden = x.new_empty(num_slots, inter)
    out = x.new_empty(num_slots, hidden_size)
    up, down = config.up, config.down
    args = (x, w13, shared_w13, w2, shared_w2, topk_ids, topk_weights, hidden, out,
            _slot_counters(x.device, num_slots), w13.shape[0], tokens, inter, hidden_size,
            x.stride(0), w13.stride(0), w13.stride(1), w2.stride(0), w2.stride(1))
    kwargs = dict(TOP_K=top_k, UP_BLOCK_N=up.BLOCK_N, UP_BLOCK_K=up.BLOCK_K,
                  UP_WHOLE_K=up.BLOCK_K >= hidden_size, DOWN_BLOCK_N=down.BLOCK_N,
                  DOWN_BLOCK_K=down.BLOCK_K, DOWN_WHOLE_K=down.BLOCK_K >= inter,
                  num_warps=up.num_warps, num_stages=up.num_stages,
                  **pdl_arguments(x.device, tokens))
    launch_key = (x.device, x.dtype, tokens, tuple(kwargs.items()))
    up_tiles = num_slots * triton.cdiv(inter, up.BLOCK_N)
    programs = min(up_tiles, _persistent_programs(launch_key, x.device,
                                                  config.persistent_programs_per_sm, args,
                                                  kwargs))
    _slot_moe_kernel[(programs,)](*args, **kwargs)
    return out
