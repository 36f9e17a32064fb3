"""Typed protocols of what a model plugin hands the core (``docs/plugins.md``).

``qllm.model.causal_lm.CausalLM`` is the base class models derive from; these protocols state the
same contract structurally, for type checkers and for the plugin tests' ``isinstance``
checks (they are ``runtime_checkable``: the methods must exist, their signatures are not
checked at run time).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch
from torch import nn

if TYPE_CHECKING:
    from qllm.batch import ForwardBatch
    from qllm.cache.base import CacheRequirement
    from qllm.config import EngineConfig
    from qllm.plugins.registry import Kernels


class ModelBuilder(Protocol):
    """``ModelSpec.build``: called once on the meta device with the checkpoint's
    ``transformers`` config, the chosen kernels and the engine's settings."""

    def __call__(self, hf_config, kernels: Kernels,
                 engine_config: EngineConfig) -> CausalLMModel: ...


@runtime_checkable
class CacheLayer(Protocol):
    """A module that holds a cache: its ``layer_kind`` names the cache kind it needs (through
    ``qllm_layer_kinds``), ``cache_requirement`` what it needs per unit of that kind, and the
    cache registry hands it its storage once, through ``attach_cache``."""

    layer_kind: str

    def cache_requirement(self) -> CacheRequirement: ...

    def attach_cache(self, tensors: dict[str, torch.Tensor]) -> None: ...


@runtime_checkable
class DecoderLayer(Protocol):
    """One repeated block, as ``qllm.layers.decoder_stack.DecoderStack`` calls it: the
    residual is None before the first layer; compiled on its own for decode."""

    def __call__(self, positions: torch.Tensor, hidden: torch.Tensor,
                 residual: torch.Tensor | None,
                 batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]: ...


@runtime_checkable
class CausalLMModel(Protocol):
    """What the engine calls on a model (``CausalLM`` implements the defaults)."""

    packed_modules: dict[str, tuple[str, str]]
    rotary_position_axes: int

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        """``input_ids [T]``, ``positions [T]`` (``[A, T]`` for multi-axis RoPE) -> final
        hidden states ``[T, H]``."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, H]`` -> ``[N, V]``."""

    def cache_layers(self) -> list[CacheLayer]: ...

    def decoder_layers(self) -> nn.ModuleList: ...

    def prefill_regions(self) -> list[nn.Module]: ...

    def checkpoint_name(self, name: str) -> str | tuple[str, str] | None: ...

    def tie_weights(self) -> None: ...

    def reset_derived_buffers(self) -> None: ...
