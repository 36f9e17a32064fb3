"""Rotary position embedding (NeoX layout), full or partial, from HF ``rope_parameters``."""

from __future__ import annotations

import torch
from torch import nn


def rope_theta(hf_config) -> float:
    """``rope_theta`` from ``rope_parameters`` (transformers 5) or the legacy attribute."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type != "default":
        raise NotImplementedError(f"rope_type {rope_type!r} is not supported (only 'default')")
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        raise ValueError("config has no rope_theta in rope_parameters")
    return float(theta)


class RotaryEmbedding(nn.Module):
    """Rotates the first ``rotary_dim`` dims of each head; the rest passes through.

    The cos/sin table is derived, not loaded: ``reset_derived_buffers`` rebuilds it after the
    model is materialised from the meta device.
    """

    prefill_region = True  # see CausalLM.prefill_regions

    def __init__(self, head_dim: int, rotary_dim: int, max_positions: int, theta: float):
        super().__init__()
        self.head_dim, self.rotary_dim = head_dim, rotary_dim
        self.max_positions, self.theta = max_positions, theta
        self.register_buffer("cos_sin", torch.empty(max_positions, rotary_dim),
                             persistent=False)

    def reset_derived_buffers(self) -> None:
        device = self.cos_sin.device
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, self.rotary_dim, 2, device=device,
                                                      dtype=torch.int64).float()
                                         / self.rotary_dim))
        freqs = torch.outer(torch.arange(self.max_positions, device=device).float(), inv_freq)
        cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)  # [P, rotary_dim]
        self.cos_sin.copy_(cos_sin.to(self.cos_sin.dtype))

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """``positions [T]``, ``q [T, Hq, D]``, ``k [T, Hk, D]`` -> rotated (q, k)."""
        cos, sin = self.cos_sin[positions].chunk(2, dim=-1)  # [T, rotary_dim / 2] each
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rot, rest = x[..., :self.rotary_dim], x[..., self.rotary_dim:]
        x1, x2 = rot.chunk(2, dim=-1)
        cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
        rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        return torch.cat([rotated, rest], dim=-1) if rest.shape[-1] else rotated
