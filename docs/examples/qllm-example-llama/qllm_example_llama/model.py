"""Llama on qllm's layers: GQA attention with RoPE over the paged KV cache, SwiGLU MLP.

Everything but the rotary embedding comes from the core (``qllm.layers``); each layer takes
its ops from ``kernels``, so kernel plugins serve this model as they serve Qwen.
"""

from __future__ import annotations

import torch
from torch import nn

from qllm.batch import ForwardBatch
from qllm.config import EngineConfig
from qllm.layers.attention import PagedAttention
from qllm.layers.decoder_stack import DecoderStack
from qllm.layers.embedding import LMHead
from qllm.layers.linear import Linear, PackedLinear
from qllm.layers.mlp import SwiGLUMLP
from qllm.layers.norm import RMSNorm
from qllm.layers.rotary import rope_theta
from qllm.model.causal_lm import CausalLM
from qllm.ops.rope import rotate_neox
from qllm.plugins.registry import Kernels


class Rotary(nn.Module):
    """RoPE (NeoX layout) of q and k; the cos/sin table is derived, so the core rebuilds it
    (``reset_derived_buffers``) after materialising the model from the meta device."""

    def __init__(self, head_dim: int, max_positions: int, theta: float):
        super().__init__()
        self.head_dim, self.theta = head_dim, theta
        self.register_buffer("cos_sin", torch.empty(max_positions, head_dim), persistent=False)

    def reset_derived_buffers(self) -> None:
        device = self.cos_sin.device
        exponents = torch.arange(0, self.head_dim, 2, device=device).float() / self.head_dim
        freqs = torch.outer(torch.arange(self.cos_sin.shape[0], device=device).float(),
                            1.0 / self.theta ** exponents)  # [P, D / 2]
        self.cos_sin.copy_(torch.cat([freqs.cos(), freqs.sin()], dim=-1))

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """``positions [T]``, ``q [T, Hq, D]``, ``k [T, Hk, D]`` -> rotated ``(q, k)``."""
        cos, sin = self.cos_sin[positions].chunk(2, dim=-1)  # [T, D / 2] each
        return rotate_neox(q, cos, sin), rotate_neox(k, cos, sin)


class LlamaAttention(nn.Module):
    def __init__(self, config, kernels: Kernels, cache_dtype: torch.dtype):
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or \
            config.hidden_size // config.num_attention_heads
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = PackedLinear(config.hidden_size, {"q": q_size, "k": kv_size,
                                                          "v": kv_size},
                                     kernels, bias=config.attention_bias)
        self.o_proj = Linear(q_size, config.hidden_size, kernels, bias=config.attention_bias)
        self.rotary = Rotary(self.head_dim, config.max_position_embeddings, rope_theta(config))
        # the layer that holds the cache: layer kind "full_attention" -> cache kind "paged_kv"
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, kernels,
                                   cache_dtype)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        q = q.unflatten(-1, (self.num_heads, self.head_dim))     # [T, Hq, D]
        k = k.unflatten(-1, (self.num_kv_heads, self.head_dim))  # [T, Hkv, D]
        v = v.unflatten(-1, (self.num_kv_heads, self.head_dim))  # [T, Hkv, D]
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v, batch).flatten(-2))  # [T, H]


class LlamaDecoderLayer(nn.Module):
    """``(positions, hidden, residual, batch) -> (hidden, residual)``, as ``DecoderStack``
    calls its layers; the norms add the residual (the ``add_rms_norm`` op)."""

    def __init__(self, config, kernels: Kernels, cache_dtype: torch.dtype):
        super().__init__()
        self.self_attn = LlamaAttention(config, kernels, cache_dtype)
        self.mlp = SwiGLUMLP(config.hidden_size, config.intermediate_size, kernels)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels=kernels)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps,
                                                kernels=kernels)

    def forward(self, positions, hidden, residual, batch):
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, batch)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaForCausalLM(CausalLM):
    # checkpoint projection -> (the fused parameter it loads into, its shard)
    packed_modules = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"),
                      "v_proj": ("qkv_proj", "v"), "gate_proj": ("gate_up_proj", "gate"),
                      "up_proj": ("gate_up_proj", "up")}

    def __init__(self, config, kernels: Kernels, engine_config: EngineConfig):
        super().__init__()
        if getattr(config, "mlp_bias", False):
            raise NotImplementedError("Llama with MLP biases is not supported")
        self.config = config
        self.model = DecoderStack(
            config.vocab_size, config.hidden_size,
            (LlamaDecoderLayer(config, kernels, engine_config.dtype)
             for _ in range(config.num_hidden_layers)),
            RMSNorm(config.hidden_size, config.rms_norm_eps, kernels=kernels))
        self.lm_head = LMHead(config.hidden_size, config.vocab_size, kernels)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def checkpoint_name(self, name: str) -> str | None:
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return None  # the embedding serves as the head
        return name

    def forward(self, input_ids, positions, batch):
        return self.model(input_ids, positions, batch)

    def compute_logits(self, hidden):
        return self.lm_head(hidden)
