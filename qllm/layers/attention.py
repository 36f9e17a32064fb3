"""The paged full-attention layer: stores new K/V in its pages and attends over them."""

from __future__ import annotations

import torch
from torch import nn

from qllm.batch import ForwardBatch
from qllm.cache.base import CacheRequirement
from qllm.distributed.parallel_state import TensorParallel
from qllm.ops.attention import output_gated
from qllm.plugins.registry import Kernels


def head_shards(num_heads: int, num_kv_heads: int, tp: TensorParallel
                ) -> tuple[int, int, dict[str, tuple[int, int]]]:
    """Tensor-parallel attention heads: ``(local query heads, local KV heads, shard parts of
    the packed q/k/v projection)``. Query heads are split over the ranks; KV heads too, or,
    with fewer KV heads than ranks, each replicated on ``size / num_kv_heads`` ranks (the
    ranks of one group of query heads). ``ValueError`` names a count that does not divide."""
    heads = tp.shard(num_heads, "num_attention_heads")
    kv_heads, parts, index = tp.replicated_shard(num_kv_heads, "num_key_value_heads")
    if tp.size == 1:
        return heads, kv_heads, {}
    return heads, kv_heads, {"q": (tp.size, tp.rank), "k": (parts, index),
                             "v": (parts, index)}


class PagedAttention(nn.Module):
    """Attention of ``[T, Hq, D]`` queries over the ``paged_kv`` cache of this layer.

    Its storage (``k_cache``/``v_cache``) is attached once by the cache registry; until then
    the layer cannot run. Kernels are chosen when the model is built.
    """

    layer_kind = "full_attention"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, kernels: Kernels,
                 cache_dtype: torch.dtype):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads ({num_heads}) must be a multiple of "
                             f"num_key_value_heads ({num_kv_heads})")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5
        self.cache_dtype = cache_dtype
        self._store = kernels.kv_store
        self._prefill = kernels.paged_attention_prefill
        self._decode = kernels.paged_attention_decode

    def cache_requirement(self) -> CacheRequirement:
        shape = (self.num_kv_heads, self.head_dim)
        return CacheRequirement(self.layer_kind, {"k": shape, "v": shape},
                                {"k": self.cache_dtype, "v": self.cache_dtype})

    def attach_cache(self, tensors: dict[str, torch.Tensor]) -> None:
        # Plain attributes, not buffers: torch.compile takes a module buffer's shape as
        # static, so the compiled decode layers (and their compile-cache entries) would be
        # keyed to this launch's block count, which follows the free memory; as attributes
        # their sizes are symbolic, and a launch with another block count hits the cache
        # (tests/test_compile_cache.py).
        self.k_cache, self.v_cache = tensors["k"], tensors["v"]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch,
                gate: torch.Tensor | None = None) -> torch.Tensor:
        """``q [T, Hq, D]``, ``k``/``v`` ``[T, Hkv, D]`` -> ``[T, Hq, D]``, times
        ``sigmoid(gate [T, Hq, D])`` with a gate (in the decode op's epilogue)."""
        self._store(self.k_cache, self.v_cache, k, v, batch.caches["paged_kv"].slot_mapping)
        return self.attend(q, batch, gate)

    def attend(self, q: torch.Tensor, batch: ForwardBatch,
               gate: torch.Tensor | None = None) -> torch.Tensor:
        """``forward`` once the step's keys and values are in the cache (stored by ``forward``,
        or with the RoPE by ``QKNormRotary.rotate_and_store``)."""
        if batch.is_prefill:
            out = self._prefill(q, self.k_cache, self.v_cache, batch, self.scale)
            return out if gate is None else output_gated(out, gate)
        return self._decode(q, self.k_cache, self.v_cache, batch, self.scale, gate)
