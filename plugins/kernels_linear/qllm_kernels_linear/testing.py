"""The projection shapes the GEMV is for, random inputs of the GEMV and of the residual add +
RMSNorm for the parity tests and the benchmarks, and a chain of GEMVs like one decode step's
(the programmatic-dependent-launch test and benchmark)."""

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

    inputs = LinearInputs(randn(m, k), randn(n, k, scale=k ** -0.5), randn(n) if bias else None)
    if torch.device(device).type == "cuda":
        # a GEMV launched with PDL (``qllm.plugins.pdl``) reads its weight before waiting for the
        # previous kernel, which may be the one that wrote it here
        torch.cuda.synchronize(device)
    return inputs


class ChainLayer(NamedTuple):
    """One layer's projections in ``gemv_chain``: ``in_proj [N, 2048]`` (the GDN ``in_proj``
    or the attention ``qkv_proj``), ``out_proj [2048, 4096]`` (``out_proj`` / ``o_proj``) and
    the MoE ``input_proj [264, 2048]``."""

    in_proj: torch.Tensor
    out_proj: torch.Tensor
    input_proj: torch.Tensor


def chain_layers(layers: int, device: str | torch.device = "cuda",
                 dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> list[ChainLayer]:
    """Weights of ``layers`` decode layers of Qwen3.5-35B-A3B, each its own (a step reads
    every weight once, from HBM): three GDN layers, then one attention layer, over again."""
    shapes = QWEN3_5_35B_A3B_SHAPES
    found = []
    for layer in range(layers):
        in_proj = shapes["qkv_proj" if layer % 4 == 3 else "gdn_in_proj"]
        found.append(ChainLayer(*(linear_inputs(1, *shape, dtype, device, seed=seed + layer).weight
                                  for shape in (in_proj, shapes["out_proj"],
                                                shapes["moe_input"]))))
    return found


def gemv_chain(hidden: torch.Tensor, layers: list[ChainLayer], linear) -> torch.Tensor:
    """``hidden [1, 2048]`` through ``layers``, each ``linear(x, weight, None)`` (the op, or the
    GEMV) fed by the previous one's output through elementwise ops and RMS norms, as in a
    decode step: the norm, ``in_proj``, SiLU of its first 4,096 outputs (the mixer),
    ``out_proj``, the residual add, the norm, the MoE ``input_proj``, its first output gating
    the normed state into the residual (the MoE); returns the last hidden state
    ``[1, 2048]``."""
    rms_norm = torch.nn.functional.rms_norm
    width = hidden.shape[-1:]
    for layer in layers:
        mixed = torch.nn.functional.silu(linear(rms_norm(hidden, width), layer.in_proj,
                                                None)[:, :4096])             # [1, 4096]
        hidden = hidden + linear(mixed, layer.out_proj, None)                 # [1, 2048]
        normed = rms_norm(hidden, width)
        router = linear(normed, layer.input_proj, None)                       # [1, 264]
        hidden = hidden + normed * torch.sigmoid(router[:, :1])
    return hidden


def gemv_only_chain(hidden: torch.Tensor, layers: list[ChainLayer], linear) -> torch.Tensor:
    """``hidden [1, 2048]`` through ``layers`` by their GEMVs alone, each fed straight by the
    one before: ``in_proj``, then its first 4,096 outputs (a view) through ``out_proj``. No
    kernel stands between two GEMVs: the best case for programmatic dependent launch, where
    every launch can overlap the previous GEMV's tail. Returns ``[1, 2048]``."""
    for layer in layers:
        mixed = linear(hidden, layer.in_proj, None)[:, :4096]                  # [1, 4096]
        hidden = linear(mixed, layer.out_proj, None)                           # [1, 2048]
    return hidden


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
