"""Helpers shared by the decode and prefill kernels: the input check, and in Triton paged K/V
addressing and one step of the online softmax.

Cache layout (``qllm.ops.attention``): ``[num_blocks + 1, PAGE, kv_heads, head_dim]``; token
``p`` of a sequence sits in page ``block_table[p // PAGE]`` at row ``p % PAGE``. K and V caches
share their strides. Softmax runs in base 2: scores are pre-multiplied by ``scale * log2(e)``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def checked_query(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """``q [..., Hq, D]`` with unit last stride, once the kernels can serve these inputs: ``Hq``
    a multiple of the caches' kv heads, K and V caches with the same strides and a unit last
    stride. Raises ``ValueError`` otherwise."""
    q_heads, kv_heads = q.shape[-2], k_cache.shape[2]
    if q_heads % kv_heads or k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError(f"unsupported shapes: q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}"
                         f" strides {k_cache.stride()} / {v_cache.stride()}")
    return q if q.stride(-1) == 1 else q.contiguous()


@triton.jit
def kv_offsets(block_table_row, tokens, mask, kv_head, stride_page, stride_token, stride_head,
               PAGE: tl.constexpr):
    """Element offsets of ``tokens [N]`` (positions in one sequence) for ``kv_head``: ``[N]``
    int64. ``mask [N]`` (or ``None``: all valid) guards the block-table reads; masked tokens
    get undefined offsets, so their K/V loads need the same mask."""
    page = tl.load(block_table_row + tokens // PAGE, mask=mask).to(tl.int64)
    return page * stride_page + (tokens % PAGE) * stride_token + kv_head * stride_head


@triton.jit
def attend_tile(q, k_ptr, v_ptr, offsets, key_mask, score_mask, m, l, acc,
                scale_log2, HEAD_DIM: tl.constexpr):
    """Fold one tile of keys into the running softmax state of ``q [M, D]``.

    ``offsets [N]`` address the tile's K/V rows; ``key_mask [N]`` guards their loads (``None``
    for an all-valid tile) and ``score_mask [M, N]`` hides scores (``None`` for none). Every
    row must see at least one key overall before its first fully masked tile. State: row max
    ``m [M]`` and sum ``l [M]`` (base 2), unnormalised output ``acc [M, D]`` (fp32).
    """
    dims = tl.arange(0, HEAD_DIM)
    ptrs = offsets[:, None] + dims[None, :]  # [N, D]
    if key_mask is None:
        k = tl.load(k_ptr + ptrs)
        v = tl.load(v_ptr + ptrs)
    else:
        k = tl.load(k_ptr + ptrs, mask=key_mask[:, None], other=0.0)
        v = tl.load(v_ptr + ptrs, mask=key_mask[:, None], other=0.0)
    s = tl.dot(q, tl.trans(k.to(q.dtype))) * scale_log2  # [M, N]
    if score_mask is not None:
        s = tl.where(score_mask, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
    return m_new, l, acc
