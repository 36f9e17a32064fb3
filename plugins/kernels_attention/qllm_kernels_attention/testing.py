"""Random paged-attention and q/k norm + RoPE inputs for the parity tests and the benchmarks."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qllm.batch import ForwardBatch
from qllm.cache.paged_kv import PagedKVBatch
from qllm.testing.batch import forward_batch


@dataclass
class PagedInputs:
    """Queries, filled K/V caches and the batch describing where each sequence's pages are."""

    q: torch.Tensor        # [T, Hq, D]
    k_cache: torch.Tensor  # [NB + 1, page, Hkv, D]
    v_cache: torch.Tensor
    batch: ForwardBatch
    scale: float


def paged_inputs(query_lens: list[int], context_lens: list[int], q_heads: int, kv_heads: int,
                 head_dim: int, page: int, dtype: torch.dtype = torch.bfloat16,
                 device: str | torch.device = "cpu", seed: int = 0) -> PagedInputs:
    """Sequence ``i`` holds ``context_lens[i]`` cached tokens and ``query_lens[i]`` new ones
    (their K/V already stored too). Pages are handed out in a random order, the last one is
    the padding page, and every block-table row is padded with it one column past its longest
    sequence, so kernels must follow the table and respect ``seq_lens``. ``is_prefill`` is
    false when every query length is 1."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in zip(context_lens, query_lens)]
    pages_per_seq = [-(-n // page) for n in seq_lens]
    num_pages = sum(pages_per_seq)
    order = torch.randperm(num_pages, generator=gen).tolist()
    table = torch.full((len(seq_lens), max(pages_per_seq) + 1), num_pages, dtype=torch.int32)
    for i, count in enumerate(pages_per_seq):
        table[i, :count] = torch.tensor(order[:count], dtype=torch.int32)
        order = order[count:]

    positions = torch.cat([torch.arange(c, c + n) for c, n in zip(context_lens, query_lens)])
    rows = torch.repeat_interleave(torch.arange(len(seq_lens)), torch.tensor(query_lens))
    slot_mapping = table[rows, positions // page].long() * page + positions % page  # [T]

    device_gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=device_gen, device=device).to(dtype)

    batch = forward_batch(query_lens, context_lens, device=device, caches={
        "paged_kv": PagedKVBatch(block_tables=table.to(device),
                                 slot_mapping=slot_mapping.to(device))})
    return PagedInputs(
        q=randn(sum(query_lens), q_heads, head_dim),
        k_cache=randn(num_pages + 1, page, kv_heads, head_dim),
        v_cache=randn(num_pages + 1, page, kv_heads, head_dim),
        batch=batch,
        scale=head_dim ** -0.5,
    )


def qk_inputs(q_heads: int, k_heads: int, head_dim: int, rotary_dim: int, zero_centered: bool,
              tokens: int, dtype: torch.dtype, device: str) -> tuple:
    """``qk_norm_rope``'s arguments as an attention layer passes them: q a per-head half of a
    wider projection output (Qwen3.5's query and gate), k a column slice of it, perturbed norm
    weights, the cos/sin table of ``QKNormRotary`` and positions up to 4,095."""
    generator = torch.Generator().manual_seed(tokens + q_heads + head_dim)
    width = (2 * q_heads + k_heads) * head_dim
    rows = torch.randn(tokens, width + 3, generator=generator).to(device, dtype)
    q = rows[:, :2 * q_heads * head_dim].unflatten(-1, (q_heads, 2 * head_dim))[..., :head_dim]
    k = rows[:, 2 * q_heads * head_dim:width].unflatten(-1, (k_heads, head_dim))
    center = 0.0 if zero_centered else 1.0
    q_weight, k_weight = (center + 0.1 * torch.randn(head_dim, generator=generator)
                          for _ in range(2))
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    freqs = torch.outer(torch.arange(4096).float(), inv_freq)
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)  # [P, rotary_dim]
    positions = torch.randint(0, 4096, (tokens,), generator=generator)
    return (q, k, q_weight.to(device, dtype), k_weight.to(device, dtype), cos_sin.to(device),
            positions.to(device), 1e-6, zero_centered)
