"""Gated full attention (``self_attn.*``) of Qwen3.5 / Qwen3-Next.

``q_proj`` yields query and output gate interleaved per head (``[T, H, 2 * D]`` split in
half per head); q/k get zero-centred per-head RMSNorm, then NeoX RoPE on the first
``head_dim * partial_rotary_factor`` dims; the attention output is multiplied by
``sigmoid(gate)`` before ``o_proj`` (in decode, by the attention kernel as it stores it).
"""

from __future__ import annotations

import torch
from torch import nn

from qllm.batch import ForwardBatch
from qllm.distributed.parallel_state import get_tp
from qllm.layers.attention import PagedAttention, head_shards
from qllm.layers.linear import PackedLinear, RowParallelLinear
from qllm.layers.norm import RMSNorm
from qllm.layers.rotary import MultiAxisQKNormRotary, QKNormRotary, rope_theta
from qllm.plugins.registry import Kernels

from qllm_qwen3_5.config import mrope_section_of, rotary_dim_of


class GatedAttention(nn.Module):
    def __init__(self, config, kernels: Kernels, cache_dtype: torch.dtype,
                 multi_axis_positions: bool = False):
        super().__init__()
        # this rank's heads (all of them without tensor parallelism); q_proj's rows are
        # per head, so a contiguous part of them is a part of the heads
        self.num_heads, self.num_kv_heads, parts = head_shards(
            config.num_attention_heads, config.num_key_value_heads, get_tp())
        self.head_dim = config.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = bool(getattr(config, "attention_bias", False))
        # q_proj rows are [q | gate] per head; they stay interleaved inside the "q" shard.
        self.qkv_proj = PackedLinear(config.hidden_size,
                                     {"q": 2 * q_size, "k": kv_size, "v": kv_size}, kernels,
                                     bias=bias, shard_parts=parts)
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim,
                                        config.hidden_size, kernels, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, zero_centered=True)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, zero_centered=True)
        rotary_args = (self.head_dim, rotary_dim_of(config), config.max_position_embeddings,
                       rope_theta(config), kernels)
        # the multimodal checkpoints: interleaved M-RoPE over positions [3, T]
        self.qk_rotary = MultiAxisQKNormRotary(*rotary_args, mrope_section_of(config)) \
            if multi_axis_positions else QKNormRotary(*rotary_args)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, kernels,
                                   cache_dtype)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        """``positions [T]`` (``[3, T]`` with multi-axis positions), ``hidden [T, H]`` ->
        ``[T, H]``."""
        q_gate, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        q, gate = q_gate.unflatten(-1, (self.num_heads, 2 * self.head_dim)).chunk(2, dim=-1)
        k = k.unflatten(-1, (self.num_kv_heads, self.head_dim))  # [T, Hkv, D]
        v = v.unflatten(-1, (self.num_kv_heads, self.head_dim))  # [T, Hkv, D]
        q = self.qk_rotary.rotate_and_store(positions, q, k, v, self.q_norm, self.k_norm,
                                            self.attn, batch)  # k, v into the cache
        out = self.attn.attend(q, batch, gate)                                # [T, Hq, D]
        return self.o_proj(out.flatten(-2))
