"""Which hybrid variant a checkpoint is, read off its transformers config, and the checks that
turn an inconsistent config into an error naming what is wrong."""

from __future__ import annotations

from dataclasses import dataclass

LAYER_TYPES = ("linear_attention", "full_attention")


class Qwen3_5ConfigError(ValueError):
    """The checkpoint's config cannot describe a model this plugin can build."""


@dataclass(frozen=True)
class Variant:
    """The differences between the served architectures.

    ``fused_gdn_inputs``: Qwen3-Next stores ``in_proj_qkvz`` / ``in_proj_ba`` grouped per key
    head instead of Qwen3.5's four separate projections. ``moe``: whether any layer is sparse.
    ``norm_topk_prob``: renormalise the top-k router weights (always for Qwen3.5).
    """

    name: str
    fused_gdn_inputs: bool
    moe: bool
    norm_topk_prob: bool = True


def variant_of(architecture: str, text_config) -> Variant:
    if architecture.startswith("Qwen3Next"):
        moe = getattr(text_config, "num_experts", 0) > 0
        return Variant("qwen3_next", fused_gdn_inputs=True, moe=moe,
                       norm_topk_prob=bool(getattr(text_config, "norm_topk_prob", True)))
    if architecture.startswith("Qwen3_5Moe"):
        return Variant("qwen3_5_moe", fused_gdn_inputs=False, moe=True)
    return Variant("qwen3_5", fused_gdn_inputs=False, moe=False)


def is_sparse_layer(variant: Variant, text_config, index: int) -> bool:
    """Whether layer ``index`` uses the MoE block (else the dense MLP), as transformers does."""
    if not variant.moe:
        return False
    if variant.name == "qwen3_5_moe":
        return True
    step = getattr(text_config, "decoder_sparse_step", 1) or 1
    return index not in (getattr(text_config, "mlp_only_layers", None) or []) \
        and (index + 1) % step == 0


def _positive(config, *names: str) -> None:
    for name in names:
        value = getattr(config, name, None)
        if not isinstance(value, int) or value < 1:
            raise Qwen3_5ConfigError(f"config {name} must be a positive integer, got {value!r}")


def validate(text_config, variant: Variant) -> None:
    """Raise ``Qwen3_5ConfigError`` naming the first inconsistency found."""
    c = text_config
    _positive(c, "hidden_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "linear_num_key_heads",
              "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
              "linear_conv_kernel_dim", "vocab_size")
    layer_types = list(getattr(c, "layer_types", None) or [])
    if len(layer_types) != c.num_hidden_layers:
        raise Qwen3_5ConfigError(f"config layer_types lists {len(layer_types)} layers but "
                                 f"num_hidden_layers is {c.num_hidden_layers}")
    for index, kind in enumerate(layer_types):
        if kind not in LAYER_TYPES:
            raise Qwen3_5ConfigError(f"config layer_types[{index}] is {kind!r}; {variant.name} "
                                     f"layers must be one of {LAYER_TYPES}")
    if c.num_attention_heads % c.num_key_value_heads:
        raise Qwen3_5ConfigError(f"config num_attention_heads ({c.num_attention_heads}) must be a "
                                 f"multiple of num_key_value_heads ({c.num_key_value_heads})")
    if c.linear_num_value_heads % c.linear_num_key_heads:
        raise Qwen3_5ConfigError(
            f"config linear_num_value_heads ({c.linear_num_value_heads}) must be a multiple of "
            f"linear_num_key_heads ({c.linear_num_key_heads})")
    rotary_dim = rotary_dim_of(c)
    if rotary_dim < 2 or rotary_dim % 2 or rotary_dim > c.head_dim:
        raise Qwen3_5ConfigError(f"head_dim {c.head_dim} x partial_rotary_factor gives a rotary "
                                 f"dim of {rotary_dim}; it must be even and within head_dim")
    if getattr(c, "hidden_act", "silu") != "silu":
        raise Qwen3_5ConfigError(f"config hidden_act {c.hidden_act!r} is not supported "
                                 f"(only 'silu')")
    if variant.moe:
        _positive(c, "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                  "shared_expert_intermediate_size")
        if c.num_experts_per_tok > c.num_experts:
            raise Qwen3_5ConfigError(f"config num_experts_per_tok ({c.num_experts_per_tok}) "
                                     f"exceeds num_experts ({c.num_experts})")
    if not variant.moe or any(not is_sparse_layer(variant, c, i)
                              for i in range(c.num_hidden_layers)):
        _positive(c, "intermediate_size")


def rotary_dim_of(text_config) -> int:
    params = getattr(text_config, "rope_parameters", None) or {}
    factor = params.get("partial_rotary_factor",
                        getattr(text_config, "partial_rotary_factor", 1.0))
    return int(text_config.head_dim * factor)


def mrope_section_of(text_config) -> list[int]:
    """M-RoPE's frequencies per axis (temporal, height, width) from ``rope_parameters``;
    transformers' Qwen3.5 default when absent. Qwen3.5's text rotary always interleaves the
    axes (``mrope_interleaved`` is not read by transformers either)."""
    params = getattr(text_config, "rope_parameters", None) or {}
    return list(params.get("mrope_section") or [11, 11, 10])


def vision_config_of(architecture: str, hf_config):
    """The vision tower's config for the multimodal architectures, else None."""
    if not architecture.endswith("ForConditionalGeneration"):
        return None
    return getattr(hf_config, "vision_config", None)
