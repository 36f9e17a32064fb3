"""Dense Qwen3: GQA attention with per-head q/k RMSNorm and full RoPE, SwiGLU MLP."""

from __future__ import annotations

import torch
from torch import nn

from qllm.batch import ForwardBatch
from qllm.config import EngineConfig
from qllm.distributed.parallel_state import get_tp
from qllm.layers.attention import PagedAttention, head_shards
from qllm.layers.decoder_stack import DecoderStack
from qllm.layers.embedding import LMHead
from qllm.layers.linear import PackedLinear, RowParallelLinear
from qllm.layers.mlp import SwiGLUMLP
from qllm.layers.norm import RMSNorm
from qllm.layers.rotary import QKNormRotary, rope_theta
from qllm.model.causal_lm import CausalLM
from qllm.plugins.registry import Kernels


class Qwen3Attention(nn.Module):
    def __init__(self, config, kernels: Kernels, cache_dtype: torch.dtype):
        super().__init__()
        # this rank's heads (all of them without tensor parallelism)
        self.num_heads, self.num_kv_heads, parts = head_shards(
            config.num_attention_heads, config.num_key_value_heads, get_tp())
        self.head_dim = getattr(config, "head_dim", None) or \
            config.hidden_size // config.num_attention_heads
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = PackedLinear(config.hidden_size, {"q": q_size, "k": kv_size,
                                                          "v": kv_size},
                                     kernels, bias=config.attention_bias, shard_parts=parts)
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim,
                                        config.hidden_size, kernels, bias=config.attention_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_rotary = QKNormRotary(self.head_dim, self.head_dim,
                                      config.max_position_embeddings, rope_theta(config),
                                      kernels)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, kernels,
                                   cache_dtype)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        q = q.unflatten(-1, (self.num_heads, self.head_dim))     # [T, Hq, D]
        k = k.unflatten(-1, (self.num_kv_heads, self.head_dim))  # [T, Hkv, D]
        v = v.unflatten(-1, (self.num_kv_heads, self.head_dim))  # [T, Hkv, D]
        q = self.qk_rotary.rotate_and_store(positions, q, k, v, self.q_norm, self.k_norm,
                                            self.attn, batch)  # k, v into the cache
        out = self.attn.attend(q, batch)                                      # [T, Hq, D]
        return self.o_proj(out.flatten(-2))


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, config, kernels: Kernels, cache_dtype: torch.dtype):
        super().__init__()
        self.self_attn = Qwen3Attention(config, kernels, cache_dtype)
        self.mlp = SwiGLUMLP(config.hidden_size, config.intermediate_size, kernels)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps,
                                       kernels=kernels)
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


class Qwen3ForCausalLM(CausalLM):
    packed_modules = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"),
                      "v_proj": ("qkv_proj", "v"), "gate_proj": ("gate_up_proj", "gate"),
                      "up_proj": ("gate_up_proj", "up")}

    def __init__(self, config, kernels: Kernels, engine_config: EngineConfig):
        super().__init__()
        if getattr(config, "use_sliding_window", False):
            raise NotImplementedError("Qwen3 sliding-window attention is not supported")
        self.config = config
        self.model = DecoderStack(
            config.vocab_size, config.hidden_size,
            (Qwen3DecoderLayer(config, kernels, engine_config.dtype)
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
