"""Gated RMSNorm: the output norm of Gated DeltaNet (``linear_attn.norm``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNormGated(nn.Module):
    """``(w * x_hat) * silu(gate)`` over the last dim, ``x_hat`` normalised in fp32.

    Unlike the other Qwen3.5 norms the weight is plain (initialised to 1), not zero-centred.
    Follows transformers' ``Qwen3_5RMSNormGated`` cast for cast: ``x_hat`` is cast back to the
    input dtype before the weight, the gate is applied in fp32, the result is cast back.
    """

    prefill_region = True  # see CausalLM.prefill_regions

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """``x``, ``gate`` ``[..., D]`` -> ``[..., D]`` in ``x.dtype``."""
        dtype = x.dtype
        hidden = x.float()
        hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.eps)
        hidden = self.weight * hidden.to(dtype)
        return (hidden * F.silu(gate.float())).to(dtype)
