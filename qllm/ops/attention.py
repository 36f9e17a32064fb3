"""Plain-torch reference kernels for paged attention (CPU-correct; the GPU kernels' oracle).

Cache layout, per full-attention layer: ``k_cache`` / ``v_cache`` ``[num_blocks + 1, block_size,
kv_heads, head_dim]``. Token ``p`` of a sequence lives in block ``block_tables[i, p // block_size]``
at offset ``p % block_size``; its flat entry is ``block * block_size + offset``. The kernels read
the block tables off the batch's ``paged_kv`` fields, ``batch.caches["paged_kv"]``
(``qllm.cache.paged_kv.PagedKVBatch``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qllm.batch import ForwardBatch
from qllm.ops.rope import qk_norm_rope


def kv_store(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write new keys/values ``[T, kv_heads, head_dim]`` to their flat entries ``[T]``.

    The caches are indexed by (block, offset) rather than written through a flat view: under
    ``torch.compile`` (torch 2.11) an in-place write to a view of a graph input is not turned
    back in place, and the compiled step then copies the whole cache twice per layer.
    """
    blocks, offsets = slot_mapping // k_cache.shape[1], slot_mapping % k_cache.shape[1]
    k_cache.index_put_((blocks, offsets), k.to(k_cache.dtype))
    v_cache.index_put_((blocks, offsets), v.to(v_cache.dtype))


def qk_norm_rope_kv_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          q_weight: torch.Tensor, k_weight: torch.Tensor,
                          cos_sin: torch.Tensor, positions: torch.Tensor, eps: float,
                          zero_centered: bool, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          slot_mapping: torch.Tensor) -> torch.Tensor:
    """``qk_norm_rope`` (``qllm.ops.rope``), then ``kv_store`` of its keys and ``v [T, Hk, D]``
    at ``slot_mapping [T]``: the step's new keys and values in the caches, in place. Returns
    the normalised and rotated ``q [T, Hq, D]``."""
    q, k = qk_norm_rope(q, k, q_weight, k_weight, cos_sin, positions, eps, zero_centered)
    kv_store(k_cache, v_cache, k, v, slot_mapping)
    return q


def _gather_pages(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """``[num_blocks + 1, bs, H, D]`` pages listed in ``block_table [..., W]`` ->
    ``[..., W * bs, H, D]``."""
    pages = cache[block_table]  # [..., W, bs, H, D]
    return pages.flatten(-4, -3)


def paged_attention_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            batch: ForwardBatch, scale: float) -> torch.Tensor:
    """Causal attention of new tokens ``q [T, Hq, D]`` over each sequence's cached prefix and
    themselves (the new K/V must already be stored). Returns ``[T, Hq, D]``."""
    out = torch.empty_like(q)
    block_tables = batch.caches["paged_kv"].block_tables  # [B, W]
    # lengths from the step's tensors, not its host copies: a graph replay refreshes only these
    starts = batch.query_start_loc.tolist()
    for i, seq_len in enumerate(batch.seq_lens.tolist()):
        start, query_len = starts[i], starts[i + 1] - starts[i]
        num_blocks = -(-seq_len // k_cache.shape[1])
        table = block_tables[i, :num_blocks]
        k = _gather_pages(k_cache, table)[:seq_len]  # [S, Hkv, D]
        v = _gather_pages(v_cache, table)[:seq_len]
        context = seq_len - query_len
        query_pos = torch.arange(query_len, device=q.device)[:, None] + context
        mask = torch.arange(seq_len, device=q.device)[None, :] <= query_pos  # [Q, S]
        out[start:start + query_len] = F.scaled_dot_product_attention(
            q[start:start + query_len].transpose(0, 1), k.transpose(0, 1).to(q.dtype),
            v.transpose(0, 1).to(q.dtype), attn_mask=mask, scale=scale, enable_gqa=True,
        ).transpose(0, 1)
    return out


def output_gated(out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``out * sigmoid(gate)`` (gated attention's output gate, ``[..., Hq, D]`` each), in fp32
    and rounded once to ``out.dtype``."""
    return (out.float() * torch.sigmoid(gate.float())).to(out.dtype)


def paged_attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           batch: ForwardBatch, scale: float,
                           gate: torch.Tensor | None = None) -> torch.Tensor:
    """One query per sequence, ``q [B, Hq, D]``, over its first ``seq_lens[i]`` cached tokens;
    with ``gate [B, Hq, D]`` (any strides), the output gated by it (``output_gated``: the
    kernels fold Qwen3.5's output gate into their epilogue). Tensor-only (no host sync), so it
    can be captured in a CUDA graph. Returns ``[B, Hq, D]``."""
    block_tables = batch.caches["paged_kv"].block_tables  # [B, W]
    k = _gather_pages(k_cache, block_tables).to(q.dtype)  # [B, S, Hkv, D]
    v = _gather_pages(v_cache, block_tables).to(q.dtype)
    positions = torch.arange(k.shape[1], device=q.device)
    mask = positions[None, :] < batch.seq_lens[:, None]  # [B, S]
    out = F.scaled_dot_product_attention(
        q[:, :, None, :], k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True)  # [B, Hq, 1, D]
    return out[:, :, 0, :] if gate is None else output_gated(out[:, :, 0, :], gate)
