"""Sparse MoE block (``mlp.*``): fp32 softmax router, top-k, renormalise, SwiGLU experts,
plus a shared expert scaled by ``sigmoid(shared_expert_gate(x))``.

The ``moe_router`` op gives each token ``k + 1`` slots: its top-``k`` routed experts, then the
shared expert (id ``E``, past the ``E`` routed ones) weighted by the sigmoid of its gate. When
the shared expert has the routed experts' size (every released checkpoint), the ``fused_moe``
op computes all ``k + 1`` slots, so GPU plugins replace the whole block's expert work with one
grouped computation (no separate shared-expert matmuls, activation and combine). Otherwise the
op computes the ``k`` routed slots and the shared expert runs as its own SwiGLU MLP, its gated
output appended as slot ``k + 1``. The router's and the shared gate's rows of the input share
one matmul; the plain-torch references of both ops are the core's (``qllm.ops.moe``).
"""

from __future__ import annotations

import torch
from torch import nn

from qllm.distributed.parallel_state import TensorParallel, all_reduce, get_tp
from qllm.distributed.shards import narrow_part, narrow_sections
from qllm.layers.linear import PackedLinear, default_weight_loader
from qllm.layers.mlp import SwiGLUMLP
from qllm.layers.norm import RMSNorm
from qllm.plugins.registry import Kernels


class StackedExpertWeight(nn.Module):
    """``weight [E, len(parts) * rows, cols]``: one projection of every expert, stacked.

    Loads whole (HF's fused ``experts.gate_up_proj`` / ``experts.down_proj``) or per expert
    from ``experts.{e}.{part}_proj.weight`` as shard ``"{part}:{e}"``; with several parts
    (gate, up) each expert's rows are the parts in order.
    """

    def __init__(self, num_experts: int, parts: tuple[str, ...], rows: int, cols: int,
                 tp: TensorParallel | None = None, split_dim: int = 0):
        super().__init__()
        self.rows, self.num_parts = rows, len(parts)
        self.weight = nn.Parameter(torch.empty(num_experts, len(parts) * rows, cols))
        self.shard_offsets = {f"{part}:{e}": (e, i * rows)
                              for e in range(num_experts) for i, part in enumerate(parts)}
        # tensor parallel: each part's dim `split_dim` (0: rows, 1: columns) is this rank's
        # share of the checkpoint's
        self.tp, self.split_dim = tp or get_tp(), split_dim

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard: str | None = None) -> None:
        tp, dim = self.tp, self.split_dim
        if shard is None:  # [E, parts * rows, cols], each part split on its own
            if dim == 0:
                pieces = narrow_sections(loaded, 1, [loaded.shape[1] // self.num_parts]
                                         * self.num_parts, tp.size, tp.rank)
            else:
                pieces = [narrow_part(loaded, 2, tp.size, tp.rank)]
            for i, piece in enumerate(pieces):
                default_weight_loader(param.data.narrow(1, i * self.rows, self.rows), piece)
            return
        expert, offset = self.shard_offsets[shard]
        default_weight_loader(param.data[expert].narrow(0, offset, self.rows),
                              narrow_part(loaded, dim, tp.size, tp.rank))


class Experts(nn.Module):
    """The routed experts, ``gate_up_proj.weight [E, 2I, H]`` (gate rows first) and
    ``down_proj.weight [E, H, I]`` (see ``Qwen3_5ForCausalLM.checkpoint_name`` for the
    checkpoint names), run by the ``fused_moe`` op, with the shared expert's weights as
    expert ``E`` (``forward``) or alone (``routed``). Tensor parallel: each expert's
    intermediate dimension is split over the ranks (gate/up rows, down columns)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 kernels: Kernels, tp: TensorParallel | None = None):
        super().__init__()
        tp = tp or get_tp()
        local = tp.shard(intermediate_size, "moe_intermediate_size")
        self.gate_up_proj = StackedExpertWeight(num_experts, ("gate", "up"), local,
                                                hidden_size, tp=tp, split_dim=0)
        self.down_proj = StackedExpertWeight(num_experts, ("down",), hidden_size, local,
                                             tp=tp, split_dim=1)
        self._fused_moe = kernels.fused_moe

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                shared_w13: torch.Tensor, shared_w2: torch.Tensor) -> torch.Tensor:
        """``x [T, H]``, routing ``[T, k + 1]`` (the last slot the shared expert's), the shared
        expert's ``[2I, H]`` and ``[H, I]`` weights -> each slot's weighted expert output
        ``[T, k + 1, H]``, summed by the residual add that follows."""
        return self._fused_moe(x, self.gate_up_proj.weight, self.down_proj.weight,
                               topk_weights, topk_ids, shared_w13, shared_w2)

    def routed(self, x: torch.Tensor, topk_weights: torch.Tensor,
               topk_ids: torch.Tensor) -> torch.Tensor:
        """``x [T, H]``, routing ``[T, k]`` among the routed experts only -> each slot's
        weighted expert output ``[T, k, H]``. No slot names expert ``E``, so the op never reads
        its shared-expert weights: expert 0's fill them, of the shapes the op checks."""
        w13, w2 = self.gate_up_proj.weight, self.down_proj.weight
        return self._fused_moe(x, w13, w2, topk_weights, topk_ids, w13[0], w2[0])


class Router(nn.Module):
    """Router and shared-gate logits -> routing weights and expert ids through the
    ``moe_router`` op."""

    def __init__(self, top_k: int, renormalize: bool, kernels: Kernels):
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize
        self._route = kernels.moe_router

    def forward(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``logits [T, E + 1]`` -> ``(weights [T, k + 1] in logits.dtype, expert ids
        [T, k + 1])``, the last slot the shared expert's."""
        return self._route(logits, self.top_k, self.renormalize)


# Shards of ``SparseMoeBlock.input_proj``, keyed by the HF module that holds each one.
INPUT_PROJ_SHARDS = {"gate": "router", "shared_expert_gate": "shared_expert_gate"}


class SparseMoeBlock(nn.Module):
    """Routed experts plus a gated shared expert. ``input_proj`` packs the rows of HF's
    ``gate`` (router) and ``shared_expert_gate`` (``INPUT_PROJ_SHARDS``), adjacent so that
    the router op reads both as one ``[T, E + 1]`` view, the rows padded to a multiple of 8
    (16-byte aligned output rows); ``shared_expert`` holds the shared expert, run inside the
    ``fused_moe`` op when ``shared_expert_fused`` (it has the routed experts' size), else on
    its own."""

    def __init__(self, config, kernels: Kernels, renormalize: bool):
        super().__init__()
        self.num_experts = config.num_experts
        self.input_proj = PackedLinear(config.hidden_size, {
            "router": config.num_experts, "shared_expert_gate": 1}, kernels, row_multiple=8)
        # 8-bit weight formats keep the router's logits in full precision (Qwen's FP8
        # checkpoints keep gate and shared_expert_gate in bf16 too)
        self.input_proj.quantizable = False
        self._add_rms_norm_linear = kernels.add_rms_norm_linear
        self.router = Router(config.num_experts_per_tok, renormalize, kernels)
        self.tp = get_tp()
        self.experts = Experts(config.num_experts, config.hidden_size,
                               config.moe_intermediate_size, kernels, self.tp)
        # tensor parallel: the routed and the shared experts' partial outputs are summed
        # over the ranks by one all-reduce after the block
        self.shared_expert = SwiGLUMLP(config.hidden_size,
                                       config.shared_expert_intermediate_size, kernels,
                                       reduce=False)
        self.shared_expert_fused = (config.shared_expert_intermediate_size
                                    == config.moe_intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, H]`` -> the per-slot outputs ``[T, k + 1, H]`` (the last slot the shared
        expert's), whose sum is the block's output: the decoder layer's residual add
        (``RMSNorm`` with a residual) takes them."""
        return self._experts(x, self.input_proj(x))

    def after_add_norm(self, branch: torch.Tensor, residual: torch.Tensor,
                       norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """The block after the residual add and ``norm`` of the branch before it: ``branch``
        and ``residual [T, H]`` -> ``(forward(x), x_sum)`` with ``(x, x_sum) = norm(branch,
        residual)``, the add and the norm computed with the router's projection (the
        ``add_rms_norm_linear`` op: in a decode step, one kernel for the three)."""
        logits, x, summed = self._add_rms_norm_linear(branch, residual, norm.weight, norm.eps,
                                                      norm.zero_centered,
                                                      self.input_proj.weight)
        return self._experts(x, logits), summed

    def _experts(self, x: torch.Tensor, projected: torch.Tensor) -> torch.Tensor:
        """``x [T, H]`` and ``input_proj(x)`` (rows padded) -> ``forward(x)``."""
        logits = projected[:, :self.num_experts + 1]  # [T, E + 1]: router, shared gate
        weights, ids = self.router(logits)  # [T, k + 1] each
        if self.shared_expert_fused:
            out = self.experts(x, weights, ids, self.shared_expert.gate_up_proj.weight,
                               self.shared_expert.down_proj.weight)
        else:
            out = self._routed_then_shared(x, weights, ids)
        if self.tp.size == 1:
            return out
        # each rank's slots are partial sums over its share of the intermediate dimension:
        # sum the slots here (in fp32, as the residual add would) and reduce once -> [T, H]
        return all_reduce(out.sum(dim=1, dtype=torch.float32).to(x.dtype), self.tp)

    def _routed_then_shared(self, x: torch.Tensor, weights: torch.Tensor,
                            ids: torch.Tensor) -> torch.Tensor:
        """A shared expert of another size than the routed ones: the ``k`` routed slots
        through the ``fused_moe`` op, then the shared expert's own MLP times its gate weight
        (the router's last slot) as one more slot -> ``[T, k + 1, H]``."""
        routed = self.experts.routed(x, weights[:, :-1], ids[:, :-1])  # [T, k, H]
        shared = self.shared_expert(x) * weights[:, -1:]  # [T, H]
        return torch.cat([routed, shared[:, None]], dim=1)
