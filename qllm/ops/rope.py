"""Rotary position embedding (NeoX layout, full or partial) in plain torch, and the reference of
the ``qk_norm_rope`` op (the GPU kernels' oracle): the attention layers' per-head q/k RMSNorm
followed by RoPE (Qwen3, Qwen3.5, Qwen3-Next)."""

from __future__ import annotations

import torch

from qllm.ops.norm import rms_norm


def rotate_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [T, H, D]`` with its first ``R`` dims rotated as pairs ``(i, i + R / 2)`` by ``cos``,
    ``sin [T, R / 2]``; the other ``D - R`` dims pass through. Math in ``x.dtype``."""
    rotary_dim = 2 * cos.shape[-1]
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    x1, x2 = rot.chunk(2, dim=-1)
    cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return torch.cat([rotated, rest], dim=-1) if rest.shape[-1] else rotated


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                 k_weight: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor,
                 eps: float, zero_centered: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``qk_norm_rope`` op: ``q [T, Hq, D]``, ``k [T, Hk, D]`` (any strides), each head
    RMS-normalised with ``q_weight`` / ``k_weight [D]`` (``rms_norm``), then rotated at
    ``positions [T]`` with the table ``cos_sin [P, R]`` (``[cos | sin]``, ``R / 2`` each) ->
    ``(q, k)`` of the same shapes and dtype."""
    cos, sin = cos_sin[positions].chunk(2, dim=-1)  # [T, R / 2] each
    return (rotate_neox(rms_norm(q, q_weight, eps, zero_centered), cos, sin),
            rotate_neox(rms_norm(k, k_weight, eps, zero_centered), cos, sin))
