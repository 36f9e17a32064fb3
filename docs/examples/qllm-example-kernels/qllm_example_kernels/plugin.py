"""An implementation of the ``linear`` op (reference: ``qllm.ops.linear.linear``) for fp32 on
the CPU, registered above the reference's priority 0 so that it is chosen there."""

from __future__ import annotations

import torch

from qllm.plugins.hookspecs import hookimpl
from qllm.plugins.specs import KernelSpec


def linear_addmm(x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None) -> torch.Tensor:
    """The ``linear`` op's contract: ``x [..., K]``, ``weight [N, K]``, ``bias [N]`` or
    ``None`` -> ``x @ weight.T + bias``, ``[..., N]`` in ``x.dtype``."""
    rows = x.reshape(-1, x.shape[-1])  # [M, K]
    out = torch.mm(rows, weight.t()) if bias is None else torch.addmm(bias, rows, weight.t())
    return out.view(*x.shape[:-1], weight.shape[0])


@hookimpl
def qllm_kernels():
    return [KernelSpec(op="linear", name="example-addmm", fn=linear_addmm, priority=5,
                       is_available=lambda device, dtype: device.type == "cpu"
                       and dtype == torch.float32)]
