"""Plain-torch reference of the ``fused_moe`` contract, for any storage of the experts'
weights: the model plugin's bf16 stacks and a weight-format plugin's 8-bit ones alike."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from qllm.layers.activation import silu_and_mul

# expert id -> (w13 [2I, H], w2 [H, I]) in the activation dtype; id E is the shared expert
ExpertWeights = Callable[[int], tuple[torch.Tensor, torch.Tensor]]


def grouped_moe(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                num_experts: int, expert_weights: ExpertWeights) -> torch.Tensor:
    """SwiGLU experts on their slots: ``x [T, H]``, routing ``topk_weights`` / ``topk_ids``
    ``[T, k]`` among ``num_experts`` routed experts plus the shared one (id
    ``num_experts``) -> the per-slot outputs ``[T, k, H]`` in ``x.dtype``, ``[t, j]`` being
    expert ``topk_ids[t, j]``'s output for token ``t`` times ``topk_weights[t, j]``.

    Slots are grouped per expert (a host sync), so only the experts hit are computed and
    ``expert_weights`` is asked only for those: eager use only.
    """
    weights = topk_weights.to(x.dtype)
    top_k = topk_ids.shape[1]
    out = x.new_empty(topk_ids.numel(), x.shape[1])  # [T * k, H], row t * k + j
    flat_ids = topk_ids.flatten()  # [T * k]
    order = flat_ids.argsort(stable=True)  # slots grouped by expert
    counts = torch.bincount(flat_ids, minlength=num_experts + 1).tolist()
    weight_of = weights.flatten()[order]
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        slots = order[start:start + count]  # [n]
        w13, w2 = expert_weights(expert)
        expert_out = F.linear(silu_and_mul(F.linear(x[slots // top_k], w13)), w2)  # [n, H]
        out[slots] = expert_out * weight_of[start:start + count, None]
        start += count
    return out.view(*topk_ids.shape, x.shape[1])
