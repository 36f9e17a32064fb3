"""Random routed-expert inputs for the parity tests and the benchmark."""

from __future__ import annotations

from typing import NamedTuple

import torch


class MoeInputs(NamedTuple):
    """The arguments of ``fused_moe``, in order."""

    x: torch.Tensor             # [T, H]
    w13: torch.Tensor           # [E, 2I, H], gate rows then up rows
    w2: torch.Tensor            # [E, H, I]
    topk_weights: torch.Tensor  # [T, k + 1], x.dtype: the routed k sum to 1, then the shared
    topk_ids: torch.Tensor      # [T, k + 1] int64: k distinct routed experts, then E
    shared_w13: torch.Tensor    # [2I, H]: the shared expert, id E
    shared_w2: torch.Tensor     # [H, I]


def moe_inputs(tokens: int, num_experts: int, hidden: int, inter: int, top_k: int,
               dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
               seed: int = 0, skew: float = 0.0) -> MoeInputs:
    """``x ~ N(0, 1)`` and weights scaled by ``1 / sqrt(fan-in)``, so every stage stays O(1).
    Routing is what Qwen3.5's router gives: the renormalised top-k of ``softmax(logits)``, with
    ``logits ~ N(0, 1) - skew * expert index`` (a large ``skew`` sends every token to the same
    first experts: many blocks per expert, most experts idle), then the shared expert ``E``
    weighted ``sigmoid`` of an ``N(0, 1)`` gate logit."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)

    logits = torch.randn(tokens, num_experts, generator=gen, device=device)
    logits -= skew * torch.arange(num_experts, device=device)
    weights, ids = logits.softmax(dim=-1).topk(top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    shared_weight = torch.randn(tokens, 1, generator=gen, device=device).sigmoid()
    shared_id = torch.full_like(ids[:, :1], num_experts)
    return MoeInputs(
        x=randn(tokens, hidden),
        w13=randn(num_experts, 2 * inter, hidden, scale=hidden ** -0.5),
        w2=randn(num_experts, hidden, inter, scale=inter ** -0.5),
        topk_weights=torch.cat([weights, shared_weight], dim=1).to(dtype),
        topk_ids=torch.cat([ids, shared_id], dim=1),
        shared_w13=randn(2 * inter, hidden, scale=hidden ** -0.5),
        shared_w2=randn(hidden, inter, scale=inter ** -0.5),
    )
