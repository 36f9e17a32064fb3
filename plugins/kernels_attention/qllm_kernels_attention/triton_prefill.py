"""Varlen causal paged attention for prefill and chunked prefill with a cached prefix.

One program per (query block, query head, sequence). Sequence ``i``'s new tokens are rows
``query_start_loc[i] ..`` of ``q`` and sit at positions ``context_lens[i] .. seq_lens[i] - 1``;
their K/V are already in the paged cache, behind the prefix. A block of ``BLOCK_M`` queries
starting at position ``p0`` sees every key below ``p0`` unmasked, so those tiles run without
the causal mask; only the tiles from the diagonal on are masked.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from qllm_kernels_attention.paged import attend_tile, checked_query, kv_offsets


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr,
    query_start_loc_ptr, seq_lens_ptr, context_lens_ptr, block_tables_ptr,
    scale_log2,
    stride_q_token, stride_q_head,
    stride_page, stride_token, stride_kv_head,
    stride_table,
    stride_out_token, stride_out_head,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    query_block = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    first_row = query_block * BLOCK_M
    if first_row >= q_len:
        return
    context = tl.load(context_lens_ptr + seq)
    seq_len = tl.load(seq_lens_ptr + seq)
    kv_head = head // GROUP

    rows = first_row + tl.arange(0, BLOCK_M)
    row_mask = rows < q_len
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + (q_start + rows)[:, None] * stride_q_token + head * stride_q_head
                + dims[None, :], mask=row_mask[:, None], other=0.0)  # [M, D]
    q_pos = context + rows  # [M] absolute positions

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    block_table_row = block_tables_ptr + seq * stride_table

    # Keys below the block's first position are visible to all its rows: no mask at all.
    unmasked_end = (context + first_row) // BLOCK_N * BLOCK_N
    for tile_start in range(0, unmasked_end, BLOCK_N):
        keys = tile_start + tl.arange(0, BLOCK_N)
        offsets = kv_offsets(block_table_row, keys, None, kv_head,
                             stride_page, stride_token, stride_kv_head, PAGE)
        m, l, acc = attend_tile(q, k_ptr, v_ptr, offsets, None, None, m, l, acc,
                                scale_log2, HEAD_DIM)

    # From the diagonal on: causal mask, up to the block's last position.
    masked_end = tl.minimum(seq_len, context + first_row + BLOCK_M)
    for tile_start in range(unmasked_end, masked_end, BLOCK_N):
        keys = tile_start + tl.arange(0, BLOCK_N)
        key_mask = keys < masked_end
        offsets = kv_offsets(block_table_row, keys, key_mask, kv_head,
                             stride_page, stride_token, stride_kv_head, PAGE)
        score_mask = (keys[None, :] <= q_pos[:, None]) & key_mask[None, :]  # [M, N]
        m, l, acc = attend_tile(q, k_ptr, v_ptr, offsets, key_mask, score_mask, m, l, acc,
                                scale_log2, HEAD_DIM)

    out = acc / l[:, None]
    tl.store(out_ptr + (q_start + rows)[:, None] * stride_out_token + head * stride_out_head
             + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])


def _config(head_dim: int) -> dict:
    """Tile sizes and launch options per head dim, tuned on an H200 (the head_dim 256 tiles
    need Hopper's 227 KB of shared memory)."""
    if head_dim <= 64:
        return dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)
    if head_dim <= 128:
        return dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2)
    return dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                      context_lens: torch.Tensor, block_tables: torch.Tensor,
                      max_query_len: int, scale: float) -> torch.Tensor:
    """Causal attention of new tokens ``q [T, Hq, D]`` over their sequences' cached prefix and
    themselves (their K/V already stored). ``query_start_loc [B + 1]``, ``seq_lens``,
    ``context_lens [B]`` int32; ``block_tables [B, W]``; ``max_query_len`` sizes the grid.
    Returns ``[T, Hq, D]``."""
    tokens, q_heads, head_dim = q.shape
    _, page, kv_heads, _ = k_cache.shape
    q = checked_query(q, k_cache, v_cache)
    out = q.new_empty(tokens, q_heads, head_dim)
    config = _config(head_dim)
    grid = (triton.cdiv(max_query_len, config["BLOCK_M"]), q_heads, seq_lens.shape[0])
    _prefill_kernel[grid](
        q, k_cache, v_cache, out,
        query_start_loc, seq_lens, context_lens, block_tables,
        scale * math.log2(math.e),
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=q_heads // kv_heads, HEAD_DIM=head_dim, PAGE=page, **config,
    )
    return out
