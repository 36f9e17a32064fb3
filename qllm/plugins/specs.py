"""The small frozen records that plugins hand to the core through the hooks."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

if TYPE_CHECKING:
    from qllm.plugins.protocols import ModelBuilder

HALF_DTYPES = (torch.float16, torch.bfloat16)
FLOAT_DTYPES = HALF_DTYPES + (torch.float32,)
HAS_TRITON = importlib.util.find_spec("triton") is not None


@dataclass(frozen=True)
class ModelSpec:
    """One HF architecture string and how to build it.

    ``build(hf_config, kernels, engine_config) -> CausalLM``
    (``qllm.plugins.protocols.ModelBuilder``) is called on the meta device; the core then
    materialises the module on the target device and loads its weights.
    """

    architecture: str
    build: ModelBuilder
    plugin: str


@dataclass(frozen=True)
class CacheKindSpec:
    """A named cache kind; ``factory(layers, num_units, engine_config, device)`` builds its
    pool, a ``qllm.cache.base.CachePool`` whose ``name`` is this one.

    ``bytes_per_unit(layers, engine_config)`` gives the memory one unit (a block, a slot)
    costs across all ``layers`` that use the kind, so the registry can size pools before
    allocating.
    ``fixed_units(engine_config)`` returns the unit count when the kind is not sized from
    the leftover memory budget (recurrent slots: one per running sequence), else ``None``.
    ``reserved_bytes(layers, engine_config)`` is memory the pool allocates beyond its units
    (recurrent slots: the prefix-state checkpoints), taken from the budget first.
    ``units_in_use_at_most(engine_config)`` is the most units the engine's sequences can hold
    at once (``max_num_seqs`` of ``max_model_len`` tokens), or ``None`` if unknown: a pool
    sized from the CPU's default budget (no memory asked for) gets no more.
    """

    name: str
    factory: Callable[..., Any]
    bytes_per_unit: Callable[..., int]
    fixed_units: Callable[..., int | None]
    reserved_bytes: Callable[..., int] = lambda layers, config: 0
    units_in_use_at_most: Callable[..., int | None] = lambda config: None


@dataclass(frozen=True)
class LayerKindSpec:
    """A kind of layer and the cache kind it needs."""

    name: str
    cache_kind: str


@dataclass(frozen=True)
class KernelSpec:
    """One implementation of a named op.

    ``is_available(device: torch.device, dtype: torch.dtype) -> bool`` decides whether it can
    run; among available ones the highest ``priority`` wins.
    """

    op: str
    name: str
    fn: Callable[..., Any]
    priority: int = 0
    is_available: Callable[[torch.device, torch.dtype], bool] = lambda device, dtype: True


@dataclass(frozen=True)
class WeightFormatSpec:
    """A named weight format (quantization method), e.g. 8-bit weights with scales.

    ``create(quant_config, engine_config) -> qllm.model.quantization.WeightFormat`` makes the format
    for one model: ``quant_config`` is the checkpoint's ``quantization_config`` (a dict) when
    the checkpoint is stored in this format, else ``None`` (quantize a full-precision
    checkpoint at load). ``checkpoint_methods`` lists the ``quant_method`` values of
    ``quantization_config`` that this format loads; ``ops`` the kernel ops its modules call
    (the engine checks that an implementation of each is registered).
    """

    name: str
    create: Callable[..., Any]
    plugin: str
    checkpoint_methods: tuple[str, ...] = ()
    ops: tuple[str, ...] = ()
    description: str = ""


def triton_on_cuda(dtypes: tuple[torch.dtype, ...] = HALF_DTYPES
                   ) -> Callable[[torch.device, torch.dtype], bool]:
    """A ``KernelSpec.is_available`` for Triton kernels: a CUDA device, an activation dtype
    among ``dtypes``, and Triton importable."""

    def available(device: torch.device, dtype: torch.dtype) -> bool:
        return HAS_TRITON and device.type == "cuda" and dtype in dtypes

    return available
