"""The core's own registrations, made through the same hooks as any plugin."""

from __future__ import annotations

from qllm.cache.paged_kv import PagedKVPool, bytes_per_block
from qllm.cache.recurrent_slots import RecurrentSlotPool, bytes_per_slot, default_state_checkpoints
from qllm.ops.contracts import CORE_OPS
from qllm.plugins.hookspecs import hookimpl
from qllm.plugins.specs import CacheKindSpec, KernelSpec, LayerKindSpec


@hookimpl
def qllm_cache_kinds():
    return [
        CacheKindSpec(
            name="paged_kv",
            factory=lambda layers, units, config, device: PagedKVPool(
                layers, units, device, config.block_size, config.enable_prefix_caching),
            bytes_per_unit=lambda layers, config: bytes_per_block(layers, config.block_size),
            fixed_units=lambda config: None,
            units_in_use_at_most=lambda config:
                config.max_num_seqs * -(-config.max_model_len // config.block_size)),
        CacheKindSpec(
            name="recurrent_slot",
            factory=lambda layers, units, config, device: RecurrentSlotPool(
                layers, units, device, state_checkpoint_rows(layers, config),
                config.block_size),
            bytes_per_unit=lambda layers, config: bytes_per_slot(layers),
            fixed_units=lambda config: config.max_num_seqs,
            reserved_bytes=lambda layers, config:
                bytes_per_slot(layers) * state_checkpoint_rows(layers, config)),
    ]


def state_checkpoint_rows(layers: list, config) -> int:
    """Recurrent-state checkpoint rows to allocate for ``layers``: ``prefix_state_cache_slots``
    (unset: ``default_state_checkpoints``), none while prefix caching is off."""
    if not config.enable_prefix_caching:
        return 0
    if config.prefix_state_cache_slots is not None:
        return config.prefix_state_cache_slots
    return default_state_checkpoints(bytes_per_slot(layers))


@hookimpl
def qllm_layer_kinds():
    return [
        LayerKindSpec(name="full_attention", cache_kind="paged_kv"),
        LayerKindSpec(name="linear_attention", cache_kind="recurrent_slot"),
    ]


@hookimpl
def qllm_kernels():
    """The plain-torch reference of every core op (``qllm.ops.contracts``), named ``torch``."""
    return [KernelSpec(op=op.name, name="torch", fn=op.reference) for op in CORE_OPS]
