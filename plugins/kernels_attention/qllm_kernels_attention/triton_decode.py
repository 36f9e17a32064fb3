"""Split-K ("flash-decoding") paged attention for one query token per sequence.

Stage 1 runs one program per (sequence, kv head, split). The program serves every query head
of its kv head at once (the GQA group, padded to the 16 rows ``tl.dot`` needs), so each K/V
page is read once per group. Sequence ``i`` is cut into ``num_splits`` equal spans of whole
``BLOCK_N`` tiles, sized from ``seq_lens[i]`` on the device: short sequences leave their last
splits empty, long ones spread over all of them. Each split writes its normalised partial
output and log-sum-exp; stage 2 merges the splits. With one split, stage 1 writes the output
directly and stage 2 is skipped. With an output gate (Qwen3.5's gated attention), the stage
that writes the output multiplies it by ``sigmoid(gate)`` in fp32 first, so the step needs no
kernel of its own for the gate, and the kernel after it (``o_proj``'s GEMV, launched with PDL)
follows a PDL-launched kernel and can read its first weights before it waits.

``num_splits`` depends only on shapes (batch, kv heads, block-table width) and the GPU's SM
count, never on values, so the launch is free of host syncs and capturable in a CUDA graph. In
small decode steps (``qllm.plugins.pdl``, at most ``PDL_MAX_ROWS`` rows) both stages are
launched with programmatic dependent launch and wait for the previous kernel at entry
(``qllm.plugins.pdl.pdl_enter``).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from qllm.plugins.devices import multiprocessors
from qllm.plugins.pdl import pdl_arguments, pdl_enter
from qllm_kernels_attention.paged import attend_tile, checked_query, kv_offsets

MAX_SPLITS = 64
CTAS_PER_SM = 2  # stage-1 programs to aim for per SM when choosing the split count


@triton.jit
def _gated(out, gate_ptr, offsets, mask, HAS_GATE: tl.constexpr):
    """``out`` (fp32) times ``sigmoid`` of the gate at ``gate_ptr + offsets`` (``mask``ed),
    with a gate; else ``out``."""
    if HAS_GATE:
        out = out * tl.sigmoid(tl.load(gate_ptr + offsets, mask=mask, other=0.0).to(tl.float32))
    return out


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, seq_lens_ptr, block_tables_ptr, out_ptr, lse_ptr, gate_ptr,
    scale_log2,
    stride_q_seq, stride_q_head,
    stride_gate_seq, stride_gate_head,
    stride_page, stride_token, stride_kv_head,
    stride_table,
    stride_out_seq, stride_out_head, stride_out_split,
    stride_lse_seq, stride_lse_head,
    num_splits,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr, STORE_LSE: tl.constexpr, HAS_GATE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """``HAS_GATE`` only with one split (no ``STORE_LSE``): this stage then writes the output."""
    pdl_enter(USE_PDL)  # q is the rope's output, the caches hold this step's K/V
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq)
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    rows = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + rows  # [G] query heads of this kv head
    row_mask = rows < GROUP
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + dims[None, :],
                mask=row_mask[:, None], other=0.0)  # [G, D]

    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    block_table_row = block_tables_ptr + seq * stride_table
    for tile_start in range(start, end, BLOCK_N):
        tokens = tile_start + tl.arange(0, BLOCK_N)
        key_mask = tokens < end
        offsets = kv_offsets(block_table_row, tokens, key_mask, kv_head,
                             stride_page, stride_token, stride_kv_head, PAGE)
        m, l, acc = attend_tile(q, k_ptr, v_ptr, offsets, key_mask, key_mask[None, :],
                                m, l, acc, scale_log2, HEAD_DIM)

    # An empty split (start >= seq_len) leaves l == 0: output 0, lse -inf (weight 0 in stage 2).
    out = acc / tl.where(l > 0, l, 1.0)[:, None]  # [G, D]
    out = _gated(out, gate_ptr, seq * stride_gate_seq + heads[:, None] * stride_gate_head
                 + dims[None, :], row_mask[:, None], HAS_GATE)
    out_ptrs = (out_ptr + seq * stride_out_seq + split * stride_out_split
                + heads[:, None] * stride_out_head + dims[None, :])
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])
    if STORE_LSE:
        lse_ptrs = lse_ptr + seq * stride_lse_seq + heads * stride_lse_head + split
        tl.store(lse_ptrs, m + tl.log2(l), mask=row_mask)


@triton.jit
def _decode_merge_kernel(
    part_ptr, lse_ptr, out_ptr, gate_ptr,
    stride_part_seq, stride_part_head, stride_part_split,
    stride_lse_seq, stride_lse_head,
    stride_out_seq, stride_out_head,
    stride_gate_seq, stride_gate_head,
    num_splits,
    HEAD_DIM: tl.constexpr, SPLITS_PAD: tl.constexpr, HAS_GATE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)  # the parts and log-sum-exps are the split kernel's output
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    split_mask = splits < num_splits
    dims = tl.arange(0, HEAD_DIM)

    lse = tl.load(lse_ptr + seq * stride_lse_seq + head * stride_lse_head + splits,
                  mask=split_mask, other=float("-inf"))  # [S]
    weight = tl.exp2(lse - tl.max(lse, 0))  # [S]; empty splits weigh 0
    part = tl.load(part_ptr + seq * stride_part_seq + head * stride_part_head
                   + splits[:, None] * stride_part_split + dims[None, :],
                   mask=split_mask[:, None], other=0.0)  # [S, D]
    out = tl.sum(part * weight[:, None], 0) / tl.sum(weight, 0)  # [D]
    out = _gated(out, gate_ptr, seq * stride_gate_seq + head * stride_gate_head + dims,
                 dims < HEAD_DIM, HAS_GATE)
    tl.store(out_ptr + seq * stride_out_seq + head * stride_out_head + dims,
             out.to(out_ptr.dtype.element_ty))


def _config(head_dim: int) -> dict:
    """Stage-1 tile size (keys per step) and launch options per head dim, tuned on an H200."""
    if head_dim <= 64:
        return dict(BLOCK_N=128, num_warps=4, num_stages=3)
    if head_dim <= 128:
        return dict(BLOCK_N=64, num_warps=4, num_stages=3)
    return dict(BLOCK_N=32, num_warps=4, num_stages=2)


def choose_num_splits(batch: int, kv_heads: int, max_tokens: int, head_dim: int,
                      device: torch.device) -> int:
    """Splits per sequence so ``batch * kv_heads * splits`` programs fill the GPU, never more
    than there are tiles in the longest possible sequence (``max_tokens``, the block-table
    width times the page size)."""
    wanted = triton.cdiv(CTAS_PER_SM * multiprocessors(device), batch * kv_heads)
    return max(1, min(wanted, triton.cdiv(max_tokens, _config(head_dim)["BLOCK_N"]),
                      MAX_SPLITS))


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                     gate: torch.Tensor | None = None,
                     num_splits: int | None = None) -> torch.Tensor:
    """Attention of ``q [B, Hq, D]`` over the first ``seq_lens [B]`` cached tokens of each
    sequence, whose pages are listed in ``block_tables [B, W]``, times ``sigmoid(gate)`` with
    ``gate [B, Hq, D]`` (unit last stride, else copied; any other strides). Caches: ``[NB + 1,
    PAGE, Hkv, D]``. ``num_splits`` overrides the automatic split count (tests). Returns
    ``[B, Hq, D]``."""
    batch, q_heads, head_dim = q.shape
    _, page, kv_heads, _ = k_cache.shape
    q = checked_query(q, k_cache, v_cache)
    if gate is not None:
        if gate.shape != q.shape:
            raise ValueError(f"decode_attention: gate of shape {tuple(gate.shape)} for q of "
                             f"shape {tuple(q.shape)}")
        gate = gate if gate.stride(-1) == 1 else gate.contiguous()
    gate_strides = (0, 0) if gate is None else gate.stride()[:2]
    group = q_heads // kv_heads
    if num_splits is None:
        num_splits = choose_num_splits(batch, kv_heads, block_tables.shape[1] * page, head_dim,
                                       q.device)
    out = q.new_empty(batch, q_heads, head_dim)
    pdl = pdl_arguments(q.device, batch)
    if num_splits == 1:
        part, lse = out[:, :, None, :], out  # [B, Hq, 1, D]; lse is not written
    else:
        part = torch.empty(batch, q_heads, num_splits, head_dim, dtype=torch.float32,
                           device=q.device)
        lse = torch.empty(batch, q_heads, num_splits, dtype=torch.float32, device=q.device)

    _decode_split_kernel[(batch, kv_heads, num_splits)](
        q, k_cache, v_cache, seq_lens, block_tables, part, lse, gate,
        scale * math.log2(math.e),
        q.stride(0), q.stride(1),
        *gate_strides,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        part.stride(0), part.stride(1), part.stride(2),
        lse.stride(0), lse.stride(1),
        num_splits,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        PAGE=page, STORE_LSE=num_splits > 1, HAS_GATE=gate is not None and num_splits == 1,
        **_config(head_dim), **pdl,
    )
    if num_splits > 1:
        _decode_merge_kernel[(batch, q_heads)](
            part, lse, out, gate,
            part.stride(0), part.stride(1), part.stride(2),
            lse.stride(0), lse.stride(1),
            out.stride(0), out.stride(1),
            *gate_strides,
            num_splits,
            HEAD_DIM=head_dim, SPLITS_PAD=triton.next_power_of_2(num_splits),
            HAS_GATE=gate is not None, num_warps=4, **pdl,
        )
    return out
