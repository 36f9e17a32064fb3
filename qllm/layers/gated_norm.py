"""Gated RMSNorm: the output norm of Gated DeltaNet (``linear_attn.norm``)."""

from __future__ import annotations

import torch
from torch import nn

from qllm.plugins.registry import Kernels


class RMSNormGated(nn.Module):
    """``(w * x_hat) * silu(gate)`` over the last dim through the ``rms_norm_gated`` op
    (reference and casts: ``qllm.ops.norm``).

    Unlike the other Qwen3.5 norms the weight is plain (initialised to 1), not zero-centred.
    """

    prefill_region = True  # see CausalLM.prefill_regions

    def __init__(self, hidden_size: int, kernels: Kernels, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self._rms_norm_gated = kernels.rms_norm_gated

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """``x``, ``gate`` ``[..., D]`` -> ``[..., D]`` in ``x.dtype``."""
        return self._rms_norm_gated(x, gate, self.weight, self.eps)
