"""The SwiGLU MLP of the dense Qwen layers."""

from __future__ import annotations

import torch
from torch import nn

from qllm.layers.activation import silu_and_mul
from qllm.layers.linear import Linear, PackedLinear
from qllm.plugins import Kernels


class SwiGLUMLP(nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))`` with ``gate_proj``/``up_proj`` packed
    into one matmul (``gate_up_proj``)."""

    prefill_region = True  # see CausalLM.prefill_regions

    def __init__(self, hidden_size: int, intermediate_size: int, kernels: Kernels):
        super().__init__()
        self.gate_up_proj = PackedLinear(hidden_size, {"gate": intermediate_size,
                                                       "up": intermediate_size}, kernels)
        self.down_proj = Linear(intermediate_size, hidden_size, kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, H]`` -> ``[T, H]``."""
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))
