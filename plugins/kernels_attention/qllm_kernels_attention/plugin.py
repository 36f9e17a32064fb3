"""qllm plugin entry point: registers the paged-attention kernels through ``qllm_kernels``.

- ``triton`` (priority 10): ``paged_attention_decode`` / ``paged_attention_prefill`` on CUDA
  in fp16/bf16 when Triton is importable, and ``qk_norm_rope`` (the q/k norms and RoPE before
  them), ``kv_store`` (the new keys and values into the paged cache) and the two in one kernel,
  ``qk_norm_rope_kv_store``, in any float dtype.
- ``flash_attn`` (priority 20): the same two ops through FlashAttention-2, registered only
  when ``vllm_flash_attn`` or ``flash_attn`` is installed.

``kv_store`` replaces the core's ``index_put_``, which ``torch.compile`` turned into one small
kernel per cache in the decode graph (neither launched with programmatic dependent launch)
and which took 5.6 ms of W1's 45 ms 16,384-token prefill step eagerly (about 0.2 ms a layer;
the Triton store 70 us: ``triton_kv_store``).
"""

from __future__ import annotations

import importlib.util

import torch

from qllm.plugins.hookspecs import hookimpl
from qllm.plugins.specs import FLOAT_DTYPES, HALF_DTYPES, KernelSpec, triton_on_cuda
from qllm_kernels_attention import ops

HAS_FLASH_ATTN = any(importlib.util.find_spec(name) for name in ("vllm_flash_attn", "flash_attn"))


def _triton_specs() -> list[KernelSpec]:
    return [
        KernelSpec(op="paged_attention_decode", name="triton", fn=ops.paged_attention_decode,
                   priority=10, is_available=triton_on_cuda()),
        KernelSpec(op="paged_attention_prefill", name="triton", fn=ops.paged_attention_prefill,
                   priority=10, is_available=triton_on_cuda()),
        KernelSpec(op="qk_norm_rope", name="triton", fn=ops.qk_norm_rope, priority=10,
                   is_available=triton_on_cuda(FLOAT_DTYPES)),
        KernelSpec(op="kv_store", name="triton", fn=ops.kv_store, priority=10,
                   is_available=triton_on_cuda(FLOAT_DTYPES)),
        KernelSpec(op="qk_norm_rope_kv_store", name="triton", fn=ops.qk_norm_rope_kv_store,
                   priority=10, is_available=triton_on_cuda(FLOAT_DTYPES)),
    ]


def _flash_specs() -> list[KernelSpec]:
    from qllm_kernels_attention import flash

    def available(device: torch.device, dtype: torch.dtype) -> bool:
        return device.type == "cuda" and dtype in HALF_DTYPES

    return [
        KernelSpec(op="paged_attention_decode", name="flash_attn",
                   fn=flash.paged_attention_decode, priority=20, is_available=available),
        KernelSpec(op="paged_attention_prefill", name="flash_attn",
                   fn=flash.paged_attention_prefill, priority=20, is_available=available),
    ]


@hookimpl
def qllm_kernels():
    return _triton_specs() + (_flash_specs() if HAS_FLASH_ATTN else [])
