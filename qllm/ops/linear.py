"""Plain-torch reference kernels of the ``linear`` op and of ``add_rms_norm_linear`` (the GPU
kernels' oracles).

Every dense projection of the models (``qllm.layers.linear.Linear`` and the layers built on it)
calls the op chosen for ``linear``; this reference is ``F.linear`` (cuBLAS on CUDA), so without a
kernel plugin the models compute exactly what ``nn.Linear`` would. ``add_rms_norm_linear`` is
the residual add and RMSNorm before a projection followed by it, for kernels that fuse the two
(the MoE router's projection in a decode step).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qllm.ops.norm import add_rms_norm


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The ``linear`` op: ``x [..., K]``, ``weight [N, K]``, ``bias [N]`` or ``None`` ->
    ``x @ weight.T + bias``, ``[..., N]`` in ``x.dtype`` (``x``, ``weight`` and ``bias`` share
    one dtype)."""
    return F.linear(x, weight, bias)


def add_rms_norm_linear(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                        eps: float, zero_centered: bool,
                        weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``add_rms_norm_linear`` op: ``x``, ``residual [..., D]``, ``norm_weight [D]`` and
    ``weight [N, D]``, one dtype -> ``(normed @ weight.T [..., N], normed, summed)`` where
    ``(normed, summed) = add_rms_norm(x, residual, norm_weight, eps, zero_centered)`` (the
    ``add_rms_norm`` op, ``qllm.ops.norm``): the projection of the normed rows, which the
    caller also needs (the MoE's experts read them), and the new residual stream."""
    normed, summed = add_rms_norm(x, residual, norm_weight, eps, zero_centered)
    return F.linear(normed, weight), normed, summed
