"""Random routed-expert inputs for the parity tests and the benchmark."""

from __future__ import annotations

from typing import NamedTuple

import torch


class MoeInputs(NamedTuple):
    """The arguments of ``fused_moe``, in order."""

    x: torch.Tensor             # [T, H]
    w13: torch.Tensor           # [E, 2I, H], gate rows then up rows
    w2: torch.Tensor            # [E, H, I]
    topk_weights: torch.Tensor  # [T, k], x.dtype, rows sum to 1
    topk_ids: torch.Tensor      # [T, k] int64, distinct per row


def moe_inputs(tokens: int, num_experts: int, hidden: int, inter: int, top_k: int,
               dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
               seed: int = 0, skew: float = 0.0) -> MoeInputs:
    """``x ~ N(0, 1)`` and weights scaled by ``1 / sqrt(fan-in)``, so every stage stays O(1).
    Routing is the renormalised top-k of ``softmax(logits)``, like Qwen3.5's router, with
    ``logits ~ N(0, 1) - skew * expert index``: a large ``skew`` sends every token to the same
    first experts (many blocks per expert, most experts idle)."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)

    logits = torch.randn(tokens, num_experts, generator=gen, device=device)
    logits -= skew * torch.arange(num_experts, device=device)
    weights, ids = logits.softmax(dim=-1).topk(top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return MoeInputs(
        x=randn(tokens, hidden),
        w13=randn(num_experts, 2 * inter, hidden, scale=hidden ** -0.5),
        w2=randn(num_experts, hidden, inter, scale=inter ** -0.5),
        topk_weights=weights.to(dtype),
        topk_ids=ids,
    )
