"""The Triton GEMV as the ``torch.library`` custom op ``qllm_linear::linear``, serving qllm's
``linear`` op, the residual add + RMSNorm before the projections as
``qllm_linear::add_rms_norm``, serving ``add_rms_norm``, and the two fused as
``qllm_linear::add_rms_norm_linear``, serving ``add_rms_norm_linear`` (one kernel where the
GEMV serves the rows and its tile covers all of K and ``x`` comes in one part, else the two
ops).

A custom op is opaque to ``torch.compile``: its fake implementation gives the output's shape,
so a ``fullgraph=True`` decode graph (with a symbolic batch size) stays whole and calls the op
as one node. Inside the op the row count is concrete: one row (decode at batch 1), or up to
``MAX_GEMV_ROWS`` through a small weight, runs the GEMV (``configs.serves``, measured); other
calls ``F.linear`` (cuBLAS's tensor-core GEMMs). The op and its fake exist without Triton; the
kernels are imported on the first call that needs them.
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


@torch.library.custom_op("qllm_linear::add_rms_norm", mutates_args=())
def add_rms_norm_rows(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float, zero_centered: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual [T, D]``, ``x [T, D]`` or in parts ``[T, S, D]`` -> ``(rms_norm(x +
    residual), x + residual)`` (see ``triton_norm``)."""
    from qllm_kernels_linear.triton_norm import add_rms_norm as launch

    return launch(x, residual, weight, eps, zero_centered)


@add_rms_norm_rows.register_fake
def _add_rms_norm_rows_fake(x, residual, weight, eps, zero_centered):
    return residual.new_empty(residual.shape), residual.new_empty(residual.shape)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 zero_centered: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``add_rms_norm`` for qllm (see ``qllm.ops.norm``): ``residual [..., D]`` and ``x`` of
    its shape or in parts ``[..., S, D]``, the leading dims flattened to rows."""
    normed, summed = add_rms_norm_rows(*_as_rows(x, residual), weight, eps, zero_centered)
    return normed.view(residual.shape), summed.view(residual.shape)


def _as_rows(x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., (S,) D]`` and ``residual [..., D]`` as ``[T, S, D]`` (``S = 1`` for ``x`` of
    the residual's shape) and ``[T, D]``, the leading dims flattened to rows, with unit last
    strides (what the kernels read)."""
    dim = residual.shape[-1]
    residual2 = residual.reshape(-1, dim)
    x2 = x.reshape(residual2.shape[0], -1, dim)
    return tuple(t if t.stride(-1) == 1 else t.contiguous() for t in (x2, residual2))


@torch.library.custom_op("qllm_linear::add_rms_norm_linear", mutates_args=())
def add_rms_norm_linear_rows(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                             eps: float, zero_centered: bool, weight: torch.Tensor
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``residual [T, D]``, ``x [T, S, D]`` (``S`` parts, summed first), ``weight [N, D]`` ->
    ``(normed @ weight.T, normed, x + residual)``, ``normed = rms_norm(x + residual)``: one
    kernel (``triton_norm_gemv``) for ``x`` in one part, else ``add_rms_norm`` then
    ``linear``."""
    from qllm_kernels_linear.triton_gemv import gemv_config
    from qllm_kernels_linear.triton_norm_gemv import add_rms_norm_gemv, fuses

    rows, dim = residual.shape
    if (x.shape[1] == 1 and takes_gemv(residual, weight, None)
            and x.dtype == residual.dtype == norm_weight.dtype):
        config = gemv_config(rows, weight.shape[0], dim, residual.device)
        if fuses(rows, dim, config):
            return add_rms_norm_gemv(x[:, 0], residual, norm_weight, eps, zero_centered,
                                     weight, config)
    normed, summed = add_rms_norm_rows(x, residual, norm_weight, eps, zero_centered)
    return linear(normed, weight, None), normed, summed


@add_rms_norm_linear_rows.register_fake
def _add_rms_norm_linear_rows_fake(x, residual, norm_weight, eps, zero_centered, weight):
    return (residual.new_empty(residual.shape[0], weight.shape[0]),
            residual.new_empty(residual.shape), residual.new_empty(residual.shape))


def add_rms_norm_linear(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                        eps: float, zero_centered: bool, weight: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``add_rms_norm_linear`` for qllm (see ``qllm.ops.linear``): ``residual [..., D]`` and
    ``x`` of its shape or in parts ``[..., S, D]``, the leading dims flattened to rows."""
    out, normed, summed = add_rms_norm_linear_rows(*_as_rows(x, residual), norm_weight, eps,
                                                   zero_centered, weight)
    return (out.view(*residual.shape[:-1], weight.shape[0]), normed.view(residual.shape),
            summed.view(residual.shape))
