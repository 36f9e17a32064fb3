"""New keys and values into the paged cache in one Triton kernel (contract and reference:
``qllm.ops.attention.kv_store``).

One program per token copies its ``[Hkv, D]`` key and value rows to the cache entry that
``slot_mapping`` names (page ``slot // page_size``, row ``slot % page_size``), cast to the
cache's dtype. The reference's two ``index_put_`` calls compiled to one small kernel per cache
in the decode graph, neither launched with programmatic dependent launch; eagerly, at 16,384
tokens of 8 heads x 128 (a W1 prefill step's layer) they took 205.7 us (0.65 TB/s of reads and
writes) where this kernel takes 69.6 us (1.93 TB/s; H200, ``bench_attention.py --kinds
store``, 2026-12-03).

In small decode steps (``qllm.plugins.pdl``, at most ``PDL_MAX_ROWS`` rows) it is launched with
programmatic dependent launch: it reads its token's slot, then waits for the previous kernel
(``qllm.plugins.pdl.pdl_wait``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qllm.plugins.pdl import pdl_arguments, pdl_release, pdl_wait


@triton.jit
def _kv_store_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    page_size,
    stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
    stride_kc_page, stride_kc_row, stride_kc_head,
    stride_vc_page, stride_vc_row, stride_vc_head,
    HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_release(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    elements = tl.arange(0, BLOCK)  # [BLOCK], head-major over the token's [Hkv, D]
    mask = elements < HEADS * HEAD_DIM
    head, dim = elements // HEAD_DIM, elements % HEAD_DIM
    slot = tl.load(slot_mapping_ptr + token)  # the step's metadata: before the wait
    pdl_wait(USE_PDL)  # k is the q/k norm's output, v the qkv projection's
    page, row = slot // page_size, slot % page_size  # (a division's branches: after the wait)

    key = tl.load(k_ptr + token * stride_k_tok + head * stride_k_head + dim, mask=mask)
    tl.store(k_cache_ptr + page * stride_kc_page + row * stride_kc_row
             + head * stride_kc_head + dim, key.to(k_cache_ptr.dtype.element_ty), mask=mask)
    value = tl.load(v_ptr + token * stride_v_tok + head * stride_v_head + dim, mask=mask)
    tl.store(v_cache_ptr + page * stride_vc_page + row * stride_vc_row
             + head * stride_vc_head + dim, value.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write ``k, v [T, Hkv, D]`` into ``k_cache, v_cache [pages, page_size, Hkv, D]`` at the
    flat entries ``slot_mapping [T]``, in place. Every tensor's last dimension must have
    stride 1 (the cache's is written in place, so it cannot be copied contiguous here)."""
    for name, x in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        if x.stride(-1) != 1:
            raise ValueError(f"kv_store: {name}'s last dimension has stride {x.stride(-1)}, "
                             f"not 1")
    tokens, heads, head_dim = k.shape
    if tokens == 0:
        return
    _kv_store_kernel[(tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k_cache.shape[1],
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        HEADS=heads, HEAD_DIM=head_dim, BLOCK=triton.next_power_of_2(heads * head_dim),
        num_warps=4, **pdl_arguments(k.device, tokens))
