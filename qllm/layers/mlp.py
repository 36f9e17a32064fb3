"""The SwiGLU MLP of the dense Qwen layers."""

from __future__ import annotations

import torch
from torch import nn

from qllm.distributed.parallel_state import get_tp
from qllm.layers.linear import PackedLinear, RowParallelLinear, column_parts
from qllm.ops.activation import silu_and_mul
from qllm.plugins.registry import Kernels


class SwiGLUMLP(nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))`` with ``gate_proj``/``up_proj`` packed
    into one matmul (``gate_up_proj``).

    Tensor parallel: gate/up column-parallel and ``down_proj`` row-parallel over the
    intermediate dimension, one all-reduce (``reduce=False``: none, the caller sums the
    partial outputs, e.g. the MoE block with its routed experts)."""

    prefill_region = True  # see CausalLM.prefill_regions

    def __init__(self, hidden_size: int, intermediate_size: int, kernels: Kernels,
                 reduce: bool = True):
        super().__init__()
        tp = get_tp()
        local = tp.shard(intermediate_size, "intermediate_size")
        self.gate_up_proj = PackedLinear(hidden_size, {"gate": local, "up": local}, kernels,
                                         shard_parts=column_parts(tp, ("gate", "up")))
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, kernels, tp=tp,
                                           reduce=reduce)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, H]`` -> ``[T, H]``."""
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))
