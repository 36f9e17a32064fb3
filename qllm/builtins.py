"""The core's own registrations, made through the same hooks as any plugin."""

from __future__ import annotations

from qllm.cache.paged_kv import PagedKVPool, bytes_per_block
from qllm.cache.recurrent_slots import RecurrentSlotPool, bytes_per_slot
from qllm.hookspecs import hookimpl
from qllm.ops import attention, gdn, linear, norm, rope
from qllm.specs import CacheKindSpec, KernelSpec, LayerKindSpec


@hookimpl
def qllm_cache_kinds():
    return [
        CacheKindSpec(
            name="paged_kv",
            factory=lambda layers, units, config, device: PagedKVPool(
                layers, units, device, config.block_size, config.enable_prefix_caching),
            bytes_per_unit=lambda layers, config: bytes_per_block(layers, config.block_size),
            fixed_units=lambda config: None),
        CacheKindSpec(
            name="recurrent_slot",
            factory=lambda layers, units, config, device: RecurrentSlotPool(
                layers, units, device, config.prefix_state_cache_slots, config.block_size,
                config.prefix_state_interval_blocks),
            bytes_per_unit=lambda layers, config: bytes_per_slot(layers),
            fixed_units=lambda config: config.max_num_seqs,
            reserved_bytes=lambda layers, config:
                bytes_per_slot(layers) * config.prefix_state_cache_slots),
    ]


@hookimpl
def qllm_layer_kinds():
    return [
        LayerKindSpec(name="full_attention", cache_kind="paged_kv"),
        LayerKindSpec(name="linear_attention", cache_kind="recurrent_slot"),
    ]


@hookimpl
def qllm_kernels():
    return [
        KernelSpec(op="kv_store", name="torch", fn=attention.kv_store),
        KernelSpec(op="paged_attention_prefill", name="torch",
                   fn=attention.paged_attention_prefill),
        KernelSpec(op="paged_attention_decode", name="torch",
                   fn=attention.paged_attention_decode),
        KernelSpec(op="causal_conv1d_prefill", name="torch", fn=gdn.causal_conv1d_prefill),
        KernelSpec(op="causal_conv1d_update", name="torch", fn=gdn.causal_conv1d_update),
        KernelSpec(op="gdn_prefill", name="torch", fn=gdn.gdn_prefill),
        KernelSpec(op="gdn_decode", name="torch", fn=gdn.gdn_decode),
        KernelSpec(op="linear", name="torch", fn=linear.linear),
        KernelSpec(op="add_rms_norm", name="torch", fn=norm.add_rms_norm),
        KernelSpec(op="rms_norm_gated", name="torch", fn=norm.rms_norm_gated),
        KernelSpec(op="qk_norm_rope", name="torch", fn=rope.qk_norm_rope),
    ]
