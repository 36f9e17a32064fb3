"""Plain-torch reference kernel of the ``linear`` op (the GPU kernels' oracle).

Every dense projection of the models (``qllm.layers.linear.Linear`` and the layers built on it)
calls the op chosen for ``linear``; this reference is ``F.linear`` (cuBLAS on CUDA), so without a
kernel plugin the models compute exactly what ``nn.Linear`` would.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The ``linear`` op: ``x [..., K]``, ``weight [N, K]``, ``bias [N]`` or ``None`` ->
    ``x @ weight.T + bias``, ``[..., N]`` in ``x.dtype`` (``x``, ``weight`` and ``bias`` share
    one dtype)."""
    return F.linear(x, weight, bias)
