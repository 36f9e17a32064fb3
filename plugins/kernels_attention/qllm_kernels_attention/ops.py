"""The Triton kernels as ``torch.library`` custom ops (namespace ``qllm_attn``), and the
functions registered for qllm's ops, which unpack the ``ForwardBatch`` into them.

A custom op is opaque to ``torch.compile``: its fake implementation gives the output's shape,
so a ``fullgraph=True`` decode graph stays whole and the kernel is called as one node. The ops
and their fakes exist without Triton; the kernels are imported on the first real call.
"""

from __future__ import annotations

import torch

from qllm.batch import ForwardBatch


@torch.library.custom_op("qllm_attn::paged_decode", mutates_args=())
def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                 gate: torch.Tensor | None) -> torch.Tensor:
    """Split-K paged decode attention, ``q [B, Hq, D]`` -> ``[B, Hq, D]``, times
    ``sigmoid(gate [B, Hq, D])`` with a gate."""
    from qllm_kernels_attention.triton_decode import decode_attention

    return decode_attention(q, k_cache, v_cache, seq_lens, block_tables, scale, gate)


@paged_decode.register_fake
def _paged_decode_fake(q, k_cache, v_cache, seq_lens, block_tables, scale, gate):
    return q.new_empty(q.shape)


@torch.library.custom_op("qllm_attn::paged_prefill", mutates_args=())
def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                  context_lens: torch.Tensor, block_tables: torch.Tensor,
                  max_query_len: int, scale: float) -> torch.Tensor:
    """Varlen causal paged prefill attention, ``q [T, Hq, D]`` -> ``[T, Hq, D]``."""
    from qllm_kernels_attention.triton_prefill import prefill_attention

    return prefill_attention(q, k_cache, v_cache, query_start_loc, seq_lens, context_lens,
                             block_tables, max_query_len, scale)


@paged_prefill.register_fake
def _paged_prefill_fake(q, k_cache, v_cache, query_start_loc, seq_lens, context_lens,
                        block_tables, max_query_len, scale):
    return q.new_empty(q.shape)


@torch.library.custom_op("qllm_attn::qk_norm_rope", mutates_args=())
def qk_norm_rope_heads(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                       k_weight: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor,
                       eps: float, zero_centered: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm then NeoX RoPE of ``q [T, Hq, D]`` and ``k [T, Hk, D]`` -> new
    contiguous ``(q, k)``."""
    from qllm_kernels_attention.triton_qk_norm_rope import qk_norm_rope as launch

    return launch(q, k, q_weight, k_weight, cos_sin, positions, eps, zero_centered)


@qk_norm_rope_heads.register_fake
def _qk_norm_rope_heads_fake(q, k, q_weight, k_weight, cos_sin, positions, eps,
                             zero_centered):
    return q.new_empty(q.shape), k.new_empty(k.shape)


@torch.library.custom_op("qllm_attn::kv_store", mutates_args=("k_cache", "v_cache"))
def kv_store(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """``kv_store`` for qllm (see ``qllm.ops.attention``): ``k, v [T, Hkv, D]`` into the paged
    caches at ``slot_mapping [T]``, in place."""
    from qllm_kernels_attention.triton_kv_store import store_kv

    store_kv(k_cache, v_cache, k, v, slot_mapping)


@kv_store.register_fake
def _kv_store_fake(k_cache, v_cache, k, v, slot_mapping):
    return None


@torch.library.custom_op("qllm_attn::qk_norm_rope_kv_store",
                         mutates_args=("k_cache", "v_cache"))
def qk_norm_rope_kv_store_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                q_weight: torch.Tensor, k_weight: torch.Tensor,
                                cos_sin: torch.Tensor, positions: torch.Tensor, eps: float,
                                zero_centered: bool, k_cache: torch.Tensor,
                                v_cache: torch.Tensor, slot_mapping: torch.Tensor
                                ) -> torch.Tensor:
    """``qk_norm_rope_heads`` with the keys, and ``v [T, Hk, D]``, written into the paged
    caches at ``slot_mapping [T]`` in place -> a new contiguous ``q``."""
    from qllm_kernels_attention.triton_qk_norm_rope import qk_norm_rope_kv_store as launch

    return launch(q, k, v, q_weight, k_weight, cos_sin, positions, eps, zero_centered,
                  k_cache, v_cache, slot_mapping)


@qk_norm_rope_kv_store_heads.register_fake
def _qk_norm_rope_kv_store_heads_fake(q, k, v, q_weight, k_weight, cos_sin, positions, eps,
                                      zero_centered, k_cache, v_cache, slot_mapping):
    return q.new_empty(q.shape)


def _unit_last_stride(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The kernels read rows with stride 1 (a copy only for an unusual layout)."""
    return tuple(x if x.stride(-1) == 1 else x.contiguous() for x in tensors)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                 k_weight: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor,
                 eps: float, zero_centered: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``qk_norm_rope`` for qllm (see ``qllm.ops.rope``); any token and head strides."""
    q, k, cos_sin = _unit_last_stride(q, k, cos_sin)
    return qk_norm_rope_heads(q, k, q_weight, k_weight, cos_sin, positions, eps,
                              zero_centered)


def qk_norm_rope_kv_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          q_weight: torch.Tensor, k_weight: torch.Tensor,
                          cos_sin: torch.Tensor, positions: torch.Tensor, eps: float,
                          zero_centered: bool, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          slot_mapping: torch.Tensor) -> torch.Tensor:
    """``qk_norm_rope_kv_store`` for qllm (see ``qllm.ops.attention``): one kernel, any token
    and head strides of ``q``, ``k`` and ``v``."""
    q, k, v, cos_sin = _unit_last_stride(q, k, v, cos_sin)
    return qk_norm_rope_kv_store_heads(q, k, v, q_weight, k_weight, cos_sin, positions, eps,
                                       zero_centered, k_cache, v_cache, slot_mapping)


def paged_attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           batch: ForwardBatch, scale: float,
                           gate: torch.Tensor | None = None) -> torch.Tensor:
    """``paged_attention_decode`` for qllm (see ``qllm.ops.attention``); tensor-only."""
    return paged_decode(q, k_cache, v_cache, batch.seq_lens,
                        batch.caches["paged_kv"].block_tables, scale, gate)


def paged_attention_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            batch: ForwardBatch, scale: float) -> torch.Tensor:
    """``paged_attention_prefill`` for qllm (see ``qllm.ops.attention``)."""
    return paged_prefill(q, k_cache, v_cache, batch.query_start_loc, batch.seq_lens,
                         batch.context_lens, batch.caches["paged_kv"].block_tables,
                         batch.max_query_len, scale)
