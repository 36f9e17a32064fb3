"""Hybrid Qwen3.5 / Qwen3.5-MoE / Qwen3-Next: Gated DeltaNet and gated full-attention layers
(per ``layer_types``), each followed by a dense SwiGLU MLP or a sparse MoE block.

Every RMSNorm here is zero-centred (``x_hat * (1 + w)``) except the GDN output norm.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from qllm.batch import ForwardBatch
from qllm.config import EngineConfig
from qllm.layers.decoder_stack import DecoderStack
from qllm.layers.embedding import LMHead
from qllm.layers.mlp import SwiGLUMLP
from qllm.layers.norm import RMSNorm
from qllm.model.causal_lm import CausalLM
from qllm.plugins.registry import Kernels

from qllm_qwen3_5.attention import GatedAttention
from qllm_qwen3_5.config import Variant, is_sparse_layer, validate, variant_of, vision_config_of
from qllm_qwen3_5.deltanet import GatedDeltaNet
from qllm_qwen3_5.moe import INPUT_PROJ_SHARDS, SparseMoeBlock

# Checkpoint tensors the model does not use: the multi-token-prediction head (and the vision
# tower, for the text-only architectures).
UNUSED_PREFIXES = ("mtp.", "model.mtp.")
VISION_PREFIXES = ("model.visual.", "visual.")
MULTIMODAL_PREFIX = "model.language_model."
PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
MOE_INPUT = re.compile(r"^(.*\.mlp)\.(" + "|".join(re.escape(m) for m in INPUT_PROJ_SHARDS)
                       + r")\.weight$")
FUSED_EXPERTS = re.compile(r"^.*\.mlp\.experts\.(gate_up|down)_proj$")


class DecoderLayer(nn.Module):
    def __init__(self, config, index: int, variant: Variant, kernels: Kernels,
                 engine_config: EngineConfig, multi_axis_positions: bool = False):
        super().__init__()
        self.layer_type = config.layer_types[index]
        if self.layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(config, kernels, engine_config.dtype,
                                             engine_config.recurrent_state_dtype,
                                             variant.fused_gdn_inputs)
        else:
            self.self_attn = GatedAttention(config, kernels, engine_config.dtype,
                                            multi_axis_positions)
        if is_sparse_layer(variant, config, index):
            self.mlp = SparseMoeBlock(config, kernels, variant.norm_topk_prob)
        else:
            self.mlp = SwiGLUMLP(config.hidden_size, config.intermediate_size, kernels)
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, zero_centered=True,
                                       kernels=kernels)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, zero_centered=True,
                                                kernels=kernels)

    def forward(self, positions, hidden, residual, batch: ForwardBatch):
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        if self.layer_type == "linear_attention":
            hidden = self.linear_attn(hidden, batch)
        else:
            hidden = self.self_attn(positions, hidden, batch)
        if isinstance(self.mlp, SparseMoeBlock):  # the add and norm join the router's GEMV
            return self.mlp.after_add_norm(hidden, residual, self.post_attention_layernorm)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class Qwen3_5ForCausalLM(CausalLM):
    """Serves every hybrid architecture of the plugin; ``architecture`` picks the variant.
    The multimodal ``*ForConditionalGeneration`` checkpoints also get their vision tower
    (``visual``, see ``qllm_qwen3_5.vision``) and interleaved M-RoPE over positions
    ``[3, T]`` in the attention layers (``rotary_position_axes = 3``); their image prompts are
    processed by ``qllm_qwen3_5.processing``.
    """

    packed_modules = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"),
                      "v_proj": ("qkv_proj", "v"), "gate_proj": ("gate_up_proj", "gate"),
                      "up_proj": ("gate_up_proj", "up"),
                      "in_proj_qkv": ("in_proj", "in_proj_qkv"),
                      "in_proj_z": ("in_proj", "in_proj_z"),
                      "in_proj_b": ("in_proj", "in_proj_b"),
                      "in_proj_a": ("in_proj", "in_proj_a"),
                      "in_proj_qkvz": ("in_proj", "in_proj_qkvz"),
                      "in_proj_ba": ("in_proj", "in_proj_ba")}

    def __init__(self, hf_config, kernels: Kernels, engine_config: EngineConfig,
                 architecture: str):
        super().__init__()
        config = hf_config.get_text_config()
        self.variant = variant_of(architecture, config)
        validate(config, self.variant)
        self.config = config
        self.hf_config = hf_config
        vision_config = vision_config_of(architecture, hf_config)
        self.rotary_position_axes = 3 if vision_config is not None else 1
        # transformers ties on the config the top-level model was built from
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.model = DecoderStack(
            config.vocab_size, config.hidden_size,
            (DecoderLayer(config, i, self.variant, kernels, engine_config,
                          vision_config is not None)
             for i in range(config.num_hidden_layers)),
            RMSNorm(config.hidden_size, config.rms_norm_eps, zero_centered=True,
                    kernels=kernels))
        self.lm_head = LMHead(config.hidden_size, config.vocab_size, kernels)
        if vision_config is not None:
            from qllm_qwen3_5.vision import VisionEncoder

            self.visual = VisionEncoder(vision_config)
        self.tie_weights()

    # ----------------------------------------------------------------- multimodal
    def input_processor(self, model_dir: str, tokenizer):
        """Image prompts (``qllm.model.multimodal``), for the multimodal checkpoints."""
        if not hasattr(self, "visual"):
            return None
        from qllm_qwen3_5.processing import Qwen3_5InputProcessor

        return Qwen3_5InputProcessor(model_dir, self.hf_config)

    def encode(self, item) -> torch.Tensor:
        """One image's embeddings ``[item.length, H]`` from its ``pixel_values`` and
        ``image_grid_thw``."""
        device = self.visual.pos_embed.weight.device
        return self.visual(item.data["pixel_values"].to(device),
                           item.data["image_grid_thw"])

    def tie_weights(self) -> None:
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def checkpoint_name(self, name: str):
        """Map a checkpoint tensor name to ``name``, ``(name, shard)`` or ``None`` (skip)."""
        if name.startswith(VISION_PREFIXES):
            return "visual." + name.split("visual.", 1)[1] if hasattr(self, "visual") else None
        if name.startswith(MULTIMODAL_PREFIX):
            name = "model." + name[len(MULTIMODAL_PREFIX):]
        if name.startswith(UNUSED_PREFIXES):
            return None
        if name == "lm_head.weight" and self.tie_word_embeddings:
            return None  # the embedding serves as the head
        match = PER_EXPERT.match(name)
        if match:  # experts.{e}.{part}_proj.weight -> one expert's rows of the stacked weight
            experts, index, part = match.groups()
            stacked = "gate_up_proj" if part in ("gate", "up") else "down_proj"
            return f"{experts}.{stacked}.weight", f"{part}:{index}"
        if FUSED_EXPERTS.match(name):
            return name + ".weight"
        match = MOE_INPUT.match(name)
        if match:  # the router's and the shared expert gate's rows -> one packed matmul
            mlp, module = match.groups()
            return f"{mlp}.input_proj.weight", INPUT_PROJ_SHARDS[module]
        return name

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        return self.model(input_ids, positions, batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
