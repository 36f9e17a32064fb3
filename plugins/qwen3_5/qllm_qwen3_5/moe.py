"""Sparse MoE block (``mlp.*``): fp32 softmax router, top-k, renormalise, SwiGLU experts,
plus a shared expert scaled by ``sigmoid(shared_expert_gate(x))``. The router, the shared
expert's gate and its gate/up projections all read ``x``: one packed matmul serves them.

The router's tail and the routed experts run through the ``moe_router`` and ``fused_moe`` ops
so GPU plugins can replace them; the plain-torch references below are registered by this
plugin.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qllm.layers.activation import silu_and_mul
from qllm.layers.linear import PackedLinear, default_weight_loader
from qllm.plugins import Kernels


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """Routed SwiGLU experts: ``x [T, H]``, ``w13 [E, 2I, H]`` (gate rows, then up rows),
    ``w2 [E, H, I]``, ``topk_weights`` / ``topk_ids`` ``[T, k]`` -> ``[T, H]`` in ``x.dtype``:
    row ``t`` is the sum over ``j`` of expert ``topk_ids[t, j]``'s output for token ``t`` times
    ``topk_weights[t, j]``, summed in fp32 in the order of ``j``.

    Eagerly, slots are grouped per expert (host sync; only the experts hit are computed).
    Under ``torch.compile`` (the CUDA-graph decode step) every expert runs on every token and
    each slot picks its expert's row: static shapes and no host sync, but E/k times the
    work. GPU plugins are expected to replace this op.
    """
    weights = topk_weights.to(x.dtype)
    if torch.compiler.is_compiling():
        return _dense_moe(x, w13, w2, weights, topk_ids).float().sum(dim=1).to(x.dtype)
    top_k = topk_ids.shape[1]
    out = x.new_empty(topk_ids.numel(), x.shape[1])  # [T * k, H], row t * k + j
    flat_ids = topk_ids.flatten()  # [T * k]
    order = flat_ids.argsort(stable=True)  # slots grouped by expert
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    weight_of = weights.flatten()[order]
    start = 0
    for e, count in enumerate(counts):
        if count == 0:
            continue
        slots = order[start:start + count]  # [n]
        expert_out = F.linear(silu_and_mul(F.linear(x[slots // top_k], w13[e])), w2[e])
        out[slots] = expert_out * weight_of[start:start + count, None]  # [n, H]
        start += count
    return out.view(*topk_ids.shape, x.shape[1]).float().sum(dim=1).to(x.dtype)


def _dense_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
               topk_ids: torch.Tensor) -> torch.Tensor:
    """Every expert on every token; each slot takes its expert's output, times its weight."""
    hidden = silu_and_mul(torch.einsum("th,eoh->teo", x, w13))  # [T, E, I]
    out = torch.einsum("tei,ehi->teh", hidden, w2)  # [T, E, H]
    picked = out.gather(1, topk_ids[..., None].expand(-1, -1, out.shape[-1]))  # [T, k, H]
    return picked * weights[..., None]


class StackedExpertWeight(nn.Module):
    """``weight [E, len(parts) * rows, cols]``: one projection of every expert, stacked.

    Loads whole (HF's fused ``experts.gate_up_proj`` / ``experts.down_proj``) or per expert
    from ``experts.{e}.{part}_proj.weight`` as shard ``"{part}:{e}"``; with several parts
    (gate, up) each expert's rows are the parts in order.
    """

    def __init__(self, num_experts: int, parts: tuple[str, ...], rows: int, cols: int):
        super().__init__()
        self.rows = rows
        self.weight = nn.Parameter(torch.empty(num_experts, len(parts) * rows, cols))
        self.shard_offsets = {f"{part}:{e}": (e, i * rows)
                              for e in range(num_experts) for i, part in enumerate(parts)}

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard: str | None = None) -> None:
        if shard is None:
            default_weight_loader(param, loaded)
            return
        expert, offset = self.shard_offsets[shard]
        default_weight_loader(param.data[expert].narrow(0, offset, self.rows), loaded)


class Experts(nn.Module):
    """The routed experts: ``gate_up_proj.weight [E, 2I, H]`` (gate rows first) and
    ``down_proj.weight [E, H, I]``; see ``Qwen3_5ForCausalLM.checkpoint_name`` for the
    checkpoint names."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 kernels: Kernels):
        super().__init__()
        self.gate_up_proj = StackedExpertWeight(num_experts, ("gate", "up"), intermediate_size,
                                                hidden_size)
        self.down_proj = StackedExpertWeight(num_experts, ("down",), hidden_size,
                                             intermediate_size)
        self._fused_moe = kernels.fused_moe

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
        """``x [T, H]``, routing ``[T, k]`` -> the weighted sum of the routed experts ``[T, H]``."""
        return self._fused_moe(x, self.gate_up_proj.weight, self.down_proj.weight,
                               topk_weights, topk_ids)


def moe_router(logits: torch.Tensor, top_k: int,
               renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``moe_router`` op: ``logits [T, E]`` -> softmax in fp32, the ``top_k`` largest
    (descending), optionally renormalised -> ``(weights [T, k] in logits.dtype, expert ids
    [T, k] int64)``. Plain-torch reference; GPU plugins may replace it."""
    probs = logits.softmax(dim=-1, dtype=torch.float32)  # [T, E]
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids


class Router(nn.Module):
    """Router logits -> routing weights and expert ids through the ``moe_router`` op."""

    def __init__(self, top_k: int, renormalize: bool, kernels: Kernels):
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize
        self._route = kernels.moe_router

    def forward(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``logits [T, E]`` -> ``(weights [T, k] in logits.dtype, expert ids [T, k])``."""
        return self._route(logits, self.top_k, self.renormalize)


# Shards of ``SparseMoeBlock.input_proj``, keyed by the HF module that holds each one.
INPUT_PROJ_SHARDS = {"gate": "router", "shared_expert_gate": "shared_expert_gate",
                     "shared_expert.gate_proj": "shared_gate",
                     "shared_expert.up_proj": "shared_up"}


class SparseMoeBlock(nn.Module):
    """Routed experts plus a gated shared expert. ``input_proj`` packs the rows of HF's
    ``gate`` (router), ``shared_expert.{gate,up}_proj`` and ``shared_expert_gate``
    (``INPUT_PROJ_SHARDS``), the one-row gate last and the rows padded to a multiple of 8 so
    that every wide shard starts 16-byte aligned; ``shared_expert.down_proj`` keeps its
    name."""

    def __init__(self, config, kernels: Kernels, renormalize: bool):
        super().__init__()
        shared = config.shared_expert_intermediate_size
        self.input_proj = PackedLinear(config.hidden_size, {
            "router": config.num_experts, "shared_gate": shared, "shared_up": shared,
            "shared_expert_gate": 1}, row_multiple=8)
        self.router = Router(config.num_experts_per_tok, renormalize, kernels)
        self.experts = Experts(config.num_experts, config.hidden_size,
                               config.moe_intermediate_size, kernels)
        self.shared_expert = nn.ModuleDict(
            {"down_proj": nn.Linear(shared, config.hidden_size, bias=False)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, H]`` -> ``[T, H]``."""
        router_logits, shared_gate, shared_up, shared_expert_gate = self.input_proj.split(
            self.input_proj(x))  # [T, E], [T, I_shared] x 2, [T, 1]
        weights, ids = self.router(router_logits)  # [T, k] each
        routed = self.experts(x, weights, ids)  # [T, H]
        shared = self.shared_expert["down_proj"](F.silu(shared_gate) * shared_up)
        return routed + torch.sigmoid(shared_expert_gate) * shared
