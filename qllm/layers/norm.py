"""RMSNorm in its two Qwen flavours, with an optional fused residual add."""

from __future__ import annotations

import torch
from torch import nn

from qllm.ops.norm import add_rms_norm, rms_norm
from qllm.plugins.registry import Kernels


class RMSNorm(nn.Module):
    """``x_hat * w`` (Qwen3) or, with ``zero_centered``, ``x_hat * (1 + w)`` (Qwen3.5/Next),
    normalised in fp32 and cast back, as transformers does.

    Called with a ``residual [..., D]``, adds it first and returns ``(normed,
    new_residual)``, through the ``add_rms_norm`` op of ``kernels`` (without them, its
    plain-torch reference); ``x`` may then come in parts, ``[..., S, D]`` (the MoE's per-slot
    outputs), summed with the residual.
    """

    prefill_region = True  # see CausalLM.prefill_regions

    def __init__(self, hidden_size: int, eps: float = 1e-6, zero_centered: bool = False,
                 kernels: Kernels | None = None):
        super().__init__()
        self.eps = eps
        self.zero_centered = zero_centered
        self.weight = nn.Parameter(torch.zeros(hidden_size) if zero_centered
                                   else torch.ones(hidden_size))
        self._add_rms_norm = add_rms_norm if kernels is None else kernels.add_rms_norm

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.zero_centered)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self._norm(x)
        return self._add_rms_norm(x, residual, self.weight, self.eps, self.zero_centered)
