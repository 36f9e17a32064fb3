"""Paged attention through FlashAttention-2 (vLLM's ``vllm_flash_attn`` fork, else
``flash_attn``); the plugin imports this module only where one of them is installed.

Upstream ``flash_attn`` reads paged K/V only with pages of a multiple of 256 tokens; the vLLM
fork takes multiples of 16. Other page sizes fall back to the Triton kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qllm.batch import ForwardBatch
from qllm.ops.attention import output_gated
from qllm_kernels_attention import ops

try:
    import vllm_flash_attn as _fa
    PAGE_MULTIPLE = 16
except ImportError:
    import flash_attn as _fa
    PAGE_MULTIPLE = 256


def _pages_supported(k_cache: torch.Tensor) -> bool:
    return k_cache.shape[1] % PAGE_MULTIPLE == 0


@torch.library.custom_op("qllm_attn::flash_decode", mutates_args=())
def flash_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 seq_lens: torch.Tensor, block_tables: torch.Tensor,
                 scale: float) -> torch.Tensor:
    """``q [B, Hq, D]`` -> ``[B, Hq, D]`` via ``flash_attn_with_kvcache``."""
    out = _fa.flash_attn_with_kvcache(q[:, None], k_cache, v_cache, cache_seqlens=seq_lens,
                                      block_table=block_tables, softmax_scale=scale,
                                      causal=True)  # [B, 1, Hq, D]
    return out[:, 0]


@flash_decode.register_fake
def _flash_decode_fake(q, k_cache, v_cache, seq_lens, block_tables, scale):
    return q.new_empty(q.shape)


def paged_attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           batch: ForwardBatch, scale: float,
                           gate: torch.Tensor | None = None) -> torch.Tensor:
    """``paged_attention_decode`` for qllm through FlashAttention (a gate applied after it)."""
    if not _pages_supported(k_cache):
        return ops.paged_attention_decode(q, k_cache, v_cache, batch, scale, gate)
    out = flash_decode(q, k_cache, v_cache, batch.seq_lens,
                       batch.caches["paged_kv"].block_tables, scale)
    return out if gate is None else output_gated(out, gate)


def paged_attention_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            batch: ForwardBatch, scale: float) -> torch.Tensor:
    """``paged_attention_prefill`` for qllm through ``flash_attn_varlen_func`` (its causal
    mask is aligned to the end of each sequence, which is where the new tokens sit)."""
    if not _pages_supported(k_cache):
        return ops.paged_attention_prefill(q, k_cache, v_cache, batch, scale)
    cu_seqlens_k = F.pad(batch.seq_lens.cumsum(0, dtype=torch.int32), (1, 0))  # [B + 1]
    return _fa.flash_attn_varlen_func(
        q, k_cache, v_cache, cu_seqlens_q=batch.query_start_loc, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=batch.max_query_len, max_seqlen_k=batch.max_seq_len,
        softmax_scale=scale, causal=True, block_table=batch.caches["paged_kv"].block_tables)
