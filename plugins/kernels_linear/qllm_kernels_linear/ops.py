"""The Triton GEMV as the ``torch.library`` custom op ``qllm_linear::linear``, serving qllm's
``linear`` op.

A custom op is opaque to ``torch.compile``: its fake implementation gives the output's shape,
so a ``fullgraph=True`` decode graph (with a symbolic batch size) stays whole and calls the op
as one node. Inside the op the row count is concrete: one row (decode at batch 1), or up to
``MAX_GEMV_ROWS`` through a small weight, runs the GEMV (``configs.serves``, measured); other
calls ``F.linear`` (cuBLAS's tensor-core GEMMs). The op and its fake exist without Triton; the
kernel is imported on the first call that needs it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qllm_kernels_linear.configs import serves


def takes_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the op runs the GEMV: rows of ``x`` and a 2-D weight that ``configs.serves``
    (one row; a few through a small weight), contiguous weight rows, and one dtype for all
    inputs (other calls keep ``F.linear``'s behaviour, errors included)."""
    return (x.dim() >= 1 and weight.dim() == 2 and weight.stride(1) == 1
            and serves(x.shape[:-1].numel(), *weight.shape)
            and x.dtype == weight.dtype and (bias is None or bias.dtype == x.dtype))


@torch.library.custom_op("qllm_linear::linear", mutates_args=())
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [..., K]``, ``weight [N, K]``, ``bias [N]`` or ``None`` -> ``x @ weight.T + bias``,
    ``[..., N]`` in ``x.dtype``: the contract of qllm's ``linear`` op (plain-torch reference in
    ``qllm.ops.linear``). The GEMV needs CUDA tensors (or CPU ones under
    ``TRITON_INTERPRET=1``)."""
    if not takes_gemv(x, weight, bias):
        return F.linear(x, weight, bias)
    from qllm_kernels_linear.triton_gemv import gemv

    out = gemv(x.reshape(-1, x.shape[-1]), weight, bias)  # [M, N]
    return out.view(*x.shape[:-1], weight.shape[0])


@linear.register_fake
def _linear_fake(x, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])
