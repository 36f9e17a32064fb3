"""Plain-torch references of the MoE ops (the GPU kernels' oracles): ``moe_router`` (softmax
router, top-k, the shared expert as one more slot) and ``fused_moe`` (the routed SwiGLU experts
with the shared one), and ``grouped_moe``, the eager expert loop of the ``fused_moe`` contract
for any storage of the experts' weights: the model plugin's bf16 stacks and a weight-format
plugin's 8-bit ones alike.

A token's routing has ``k + 1`` slots: its top-``k`` routed experts, then the shared expert (id
``E``, past the ``E`` routed ones) weighted by the sigmoid of its gate. ``fused_moe`` returns
each slot's weighted expert output, left unsummed for the residual add that follows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from qllm.ops.activation import silu_and_mul

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


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, shared_w13: torch.Tensor,
              shared_w2: torch.Tensor) -> torch.Tensor:
    """Routed SwiGLU experts: ``x [T, H]``, ``w13 [E, 2I, H]`` (gate rows, then up rows),
    ``w2 [E, H, I]``, the shared expert's ``shared_w13 [2I, H]`` and ``shared_w2 [H, I]``
    (expert id ``E``), ``topk_weights`` / ``topk_ids`` ``[T, k]`` -> the per-slot outputs
    ``[T, k, H]`` in ``x.dtype``: ``[t, j]`` is expert ``topk_ids[t, j]``'s output for token
    ``t`` times ``topk_weights[t, j]``. The slots are left unsummed: the residual add after
    the block (the ``add_rms_norm`` op) sums them in fp32 in the order of ``j``, with the
    residual, in one pass.

    Eagerly, slots are grouped per expert (host sync; only the experts hit are computed).
    Under ``torch.compile`` (the CUDA-graph decode step) every expert runs on every token and
    each slot picks its expert's row: static shapes and no host sync, but E/k times the
    work. GPU plugins are expected to replace this op.
    """
    if torch.compiler.is_compiling():
        w13, w2 = torch.cat([w13, shared_w13[None]]), torch.cat([w2, shared_w2[None]])
        return _dense_moe(x, w13, w2, topk_weights.to(x.dtype), topk_ids)
    num_experts = w13.shape[0]
    return grouped_moe(x, topk_weights, topk_ids, num_experts, lambda e: (
        (w13[e], w2[e]) if e < num_experts else (shared_w13, shared_w2)))


def _dense_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
               topk_ids: torch.Tensor) -> torch.Tensor:
    """Every expert on every token; each slot takes its expert's output, times its weight."""
    hidden = silu_and_mul(torch.einsum("th,eoh->teo", x, w13))  # [T, E, I]
    out = torch.einsum("tei,ehi->teh", hidden, w2)  # [T, E, H]
    picked = out.gather(1, topk_ids[..., None].expand(-1, -1, out.shape[-1]))  # [T, k, H]
    return picked * weights[..., None]


def moe_router(logits: torch.Tensor, top_k: int,
               renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``moe_router`` op: ``logits [T, E + 1]``, the router's ``E`` logits then the shared
    expert's gate logit -> ``(weights [T, k + 1] in logits.dtype, expert ids [T, k + 1]
    int64)``: softmax over the ``E`` in fp32, the ``top_k`` largest (descending), optionally
    renormalised; then the shared expert, id ``E``, weighted ``sigmoid(gate logit)``.
    Plain-torch reference; GPU plugins may replace it."""
    probs = logits[:, :-1].softmax(dim=-1, dtype=torch.float32)  # [T, E]
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    shared_weight = logits[:, -1:].float().sigmoid()  # [T, 1]
    shared_id = torch.full_like(ids[:, :1], probs.shape[1])
    return (torch.cat([weights, shared_weight], dim=1).to(logits.dtype),
            torch.cat([ids, shared_id], dim=1))
