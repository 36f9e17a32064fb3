"""The contract between the core and a model plugin's ``nn.Module``."""

from __future__ import annotations

import torch
from torch import nn

from qllm.batch import ForwardBatch


class CausalLM(nn.Module):
    """Base class for models served by plugins.

    A model keeps HF parameter names. The loader maps each checkpoint tensor through
    ``checkpoint_name`` (``None`` skips it) and ``packed_modules`` (HF projection name ->
    ``(fused parameter name, shard)``, e.g. ``"q_proj": ("qkv_proj", "q")``). Modules that hold
    a cache declare ``layer_kind``, ``cache_requirement()`` and ``attach_cache(tensors)``.
    ``qllm.plugins.protocols`` states this contract as typed protocols (``CausalLMModel``,
    ``CacheLayer``, ``DecoderLayer``).
    """

    packed_modules: dict[str, tuple[str, str]] = {}
    # Axes of the rotary positions: 1 gives ``positions [T]``; a multi-axis model (M-RoPE: 3)
    # gets ``positions [A, T]`` (see ``qllm.model.multimodal``).
    rotary_position_axes: int = 1

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        """``input_ids``/``positions`` ``[T]`` -> final hidden states ``[T, H]``."""
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, H]`` -> logits ``[N, V]`` (the model's dtype)."""
        raise NotImplementedError

    def cache_layers(self) -> list[nn.Module]:
        """Every submodule that needs a cache kind, in layer order."""
        return [m for m in self.modules() if hasattr(m, "layer_kind")]

    def decoder_layers(self) -> nn.ModuleList:
        """The repeated blocks, compiled one by one (regional compilation) for decode."""
        return self.model.layers

    def prefill_regions(self) -> list[nn.Module]:
        """Submodules compiled on their own for prefill: the pointwise chains (norms, rotary,
        gated activations) that eager mode would run as a dozen kernels each. Prefill runs the
        decoder layers' plain ``forward`` (their attention takes host-side lengths that would
        specialise a layer graph per batch), so without these every chain runs unfused.
        By default, the submodules whose class sets ``prefill_region = True``."""
        return [m for m in self.modules() if getattr(m, "prefill_region", False)]

    def checkpoint_name(self, name: str) -> str | tuple[str, str] | None:
        """The model's parameter name for a checkpoint tensor name (or ``(name, shard)`` of a
        packed parameter); ``None`` to skip it."""
        return name

    def input_processor(self, model_dir: str, tokenizer):
        """A multimodal model's ``qllm.model.multimodal.InputProcessor`` (its media prompts), or
        None for a text-only model."""
        return None

    def encode(self, item) -> torch.Tensor:
        """A multimodal model's encoder (vision tower, audio encoder + projector) over one
        ``qllm.model.multimodal.EncoderInput``: its embeddings ``[item.length, H]``, which replace
        the embeddings of the item's placeholder tokens. Called once per item, at prefill."""
        raise NotImplementedError(f"{type(self).__name__} takes no media inputs")

    def tie_weights(self) -> None:
        """Re-point tied parameters after materialisation (``to_empty`` unties them)."""

    def reset_derived_buffers(self) -> None:
        """Recompute buffers that are derived rather than loaded (rotary tables...)."""
        for module in self.modules():
            if module is not self and hasattr(module, "reset_derived_buffers"):
                module.reset_derived_buffers()
