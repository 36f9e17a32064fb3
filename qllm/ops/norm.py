"""RMSNorm in plain torch: ``rms_norm`` (the models' norms, ``qllm.layers.norm.RMSNorm``, and
the q/k norms of the ``qk_norm_rope`` op), and the references of two ops (the GPU kernels'
oracles): ``add_rms_norm``, the residual add with the norm after it (``RMSNorm`` called with a
residual; a branch output in parts is summed first), and ``rms_norm_gated``, the gated RMSNorm
that closes a Gated DeltaNet layer (``qllm.layers.gated_norm.RMSNormGated``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             zero_centered: bool) -> torch.Tensor:
    """``x_hat * w`` (Qwen3) or, ``zero_centered``, ``x_hat * (1 + w)`` (Qwen3.5 / Qwen3-Next)
    over the last dim, in ``x.dtype``. Casts as transformers: ``x_hat`` in fp32; a plain weight
    multiplies ``x_hat`` cast back to ``x.dtype``, a zero-centred one multiplies in fp32."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    if zero_centered:
        return (x * (1.0 + weight.float())).to(dtype)
    return weight * x.to(dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 zero_centered: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``add_rms_norm`` op: ``residual [..., D]``, and ``x`` of its shape or ``[..., S,
    D]`` (a branch's ``S`` partial outputs: the MoE's per-slot outputs), one dtype ->
    ``(rms_norm(s), s)`` with ``s = x + residual`` (``x`` summed over ``S`` first), the new
    residual stream. The sum and the add run in fp32 and are rounded once: written so that
    inductor does not fold the add into the matmul that produced ``x`` as ``addmm`` (cuBLAS
    would first copy the residual into the output: one more kernel per layer)."""
    partials = x if x.dim() > residual.dim() else x.unsqueeze(-2)  # [..., S, D]
    summed = (partials.float().sum(dim=-2) + residual.float()).to(x.dtype)
    return rms_norm(summed, weight, eps, zero_centered), summed


def rms_norm_gated(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                   eps: float) -> torch.Tensor:
    """The ``rms_norm_gated`` op: ``x``, ``gate [..., D]`` (any strides) and ``weight [D]``,
    all in one dtype -> ``(weight * x_hat) * silu(gate)``, ``[..., D]`` contiguous in that
    dtype, ``x_hat`` the RMS-normalised ``x`` over the last dim.

    Follows transformers' ``Qwen3_5RMSNormGated`` cast for cast: ``x_hat`` is computed in fp32
    and cast back to ``x.dtype`` before the weight, the gate is applied in fp32, the result is
    cast back."""
    return (rms_norm(x, weight, eps, zero_centered=False) * F.silu(gate.float())).to(x.dtype)
