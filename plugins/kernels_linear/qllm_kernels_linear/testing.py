"""The projection shapes the GEMV is for, and random inputs of the GEMV and of the residual add +
RMSNorm for the parity tests and the benchmarks."""

from __future__ import annotations

from typing import NamedTuple

import torch

# Qwen3.5-35B-A3B (hidden 2048) projections at decode, name -> weight [N, K].
QWEN3_5_35B_A3B_SHAPES = {
    "out_proj": (2048, 4096),     # GDN out_proj and attention o_proj
    "moe_input": (264, 2048),     # MoE router + shared-expert gate, padded to 8 rows
    "gdn_in_proj": (12352, 2048),  # q, k, v, z, b, a of a GDN layer
    "qkv_proj": (9216, 2048),     # gated attention q (with gate), k, v
}


class LinearInputs(NamedTuple):
    """The arguments of ``linear``, in order."""

    x: torch.Tensor               # [M, K]
    weight: torch.Tensor          # [N, K]
    bias: torch.Tensor | None     # [N]


def linear_inputs(m: int, n: int, k: int, dtype: torch.dtype = torch.bfloat16,
                  device: str | torch.device = "cpu", bias: bool = False,
                  seed: int = 0) -> LinearInputs:
    """``x ~ N(0, 1)``, weights ``N(0, 1) / sqrt(k)`` and bias ``N(0, 1)``, so outputs are
    O(1) whatever ``k``."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)

    return LinearInputs(randn(m, k), randn(n, k, scale=k ** -0.5), randn(n) if bias else None)


def norm_inputs(rows: int, dim: int, dtype: torch.dtype, device: str | torch.device,
                zero_centered: bool, parts: int = 0
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``add_rms_norm``'s ``x [T, D]`` (rows apart in memory: a column slice of a wider
    tensor), or with ``parts``, ``[T, parts, D]`` (contiguous, as the MoE's per-slot
    outputs), ``residual [T, D]`` and a weight ``[D]`` perturbed around 0 (``zero_centered``)
    or 1."""
    gen = torch.Generator(device=device).manual_seed(rows * dim + parts)
    if parts:
        x = torch.randn(rows, parts, dim, generator=gen, device=device).to(dtype)
    else:
        x = torch.randn(rows, dim + 8, generator=gen, device=device).to(dtype)[:, :dim]
    residual = torch.randn(rows, dim, generator=gen, device=device).to(dtype)
    weight = (torch.randn(dim, generator=gen, device=device) * 0.1
              + (0.0 if zero_centered else 1.0)).to(dtype)
    return x, residual, weight
