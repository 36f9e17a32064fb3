"""Rotary position embedding (NeoX layout, full or partial) of the attention layers' q and k,
after their per-head RMSNorm; ``rope_theta`` from HF ``rope_parameters``."""

from __future__ import annotations

import torch
from torch import nn

from qllm.batch import ForwardBatch
from qllm.layers.attention import PagedAttention
from qllm.layers.norm import RMSNorm
from qllm.plugins.registry import Kernels


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


class QKNormRotary(nn.Module):
    """The attention layers' q/k path through the ``qk_norm_rope`` op (reference:
    ``qllm.ops.rope``): each head of q and k RMS-normalised by the layer's ``q_norm`` /
    ``k_norm`` (their weights keep the checkpoint's names there), then the first ``rotary_dim``
    dims rotated (NeoX layout); the rest pass through.

    The cos/sin table is derived, not loaded: ``reset_derived_buffers`` rebuilds it after the
    model is materialised from the meta device.
    """

    prefill_region = True  # see CausalLM.prefill_regions

    def __init__(self, head_dim: int, rotary_dim: int, max_positions: int, theta: float,
                 kernels: Kernels):
        super().__init__()
        self.head_dim, self.rotary_dim = head_dim, rotary_dim
        self.max_positions, self.theta = max_positions, theta
        self.register_buffer("cos_sin", torch.empty(max_positions, rotary_dim),
                             persistent=False)
        self._qk_norm_rope = kernels.qk_norm_rope
        self._qk_norm_rope_kv_store = kernels.qk_norm_rope_kv_store

    def reset_derived_buffers(self) -> None:
        device = self.cos_sin.device
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, self.rotary_dim, 2, device=device,
                                                      dtype=torch.int64).float()
                                         / self.rotary_dim))
        freqs = torch.outer(torch.arange(self.max_positions, device=device).float(), inv_freq)
        cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)  # [P, rotary_dim]
        self.cos_sin.copy_(cos_sin.to(self.cos_sin.dtype))

    def table(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions [T]`` -> the op's ``(cos_sin [P, R], rows [T])``: the table and the row
        that rotates each token."""
        return self.cos_sin, positions

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                q_norm: RMSNorm, k_norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions [T]``, ``q [T, Hq, D]``, ``k [T, Hk, D]`` -> normalised and rotated
        ``(q, k)``; ``q_norm`` and ``k_norm`` share one eps and flavour."""
        cos_sin, rows = self.table(positions)
        return self._qk_norm_rope(q, k, q_norm.weight, k_norm.weight, cos_sin, rows,
                                  q_norm.eps, q_norm.zero_centered)

    def rotate_and_store(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                         v: torch.Tensor, q_norm: RMSNorm, k_norm: RMSNorm,
                         attention: PagedAttention, batch: ForwardBatch) -> torch.Tensor:
        """``forward``, its keys and ``v [T, Hk, D]`` then stored in ``attention``'s paged
        cache at the step's slots, in one op (``qk_norm_rope_kv_store``) -> the normalised
        and rotated ``q``; ``attention.attend`` follows."""
        cos_sin, rows = self.table(positions)
        return self._qk_norm_rope_kv_store(
            q, k, v, q_norm.weight, k_norm.weight, cos_sin, rows, q_norm.eps,
            q_norm.zero_centered, attention.k_cache, attention.v_cache,
            batch.caches["paged_kv"].slot_mapping)


def mrope_axes(mrope_section: list[int], num_frequencies: int, interleaved: bool) -> list[int]:
    """Which position axis (0 temporal, 1 height, 2 width) drives each of the rotary dims'
    ``num_frequencies`` frequencies under multi-axis RoPE (M-RoPE), as transformers lays it
    out. Interleaved (Qwen3-VL, Qwen3.5): frequency ``i`` reads height when ``i % 3 == 1 and
    i < 3 * section[1]``, width when ``i % 3 == 2 and i < 3 * section[2]``, else the temporal
    axis. Sectioned (Qwen2-VL): the first ``section[0]`` frequencies temporal, the next
    ``section[1]`` height, the rest width."""
    if interleaved:
        return [1 if i % 3 == 1 and i < 3 * mrope_section[1]
                else 2 if i % 3 == 2 and i < 3 * mrope_section[2] else 0
                for i in range(num_frequencies)]
    bounds = [mrope_section[0], mrope_section[0] + mrope_section[1]]
    return [0 if i < bounds[0] else 1 if i < bounds[1] else 2 for i in range(num_frequencies)]


class MultiAxisQKNormRotary(QKNormRotary):
    """``QKNormRotary`` whose positions may have three axes (M-RoPE): ``positions [3, T]``
    (temporal, height, width; a text token has one value on all three), each rotary
    frequency driven by the axis ``mrope_axes`` gives it. Positions ``[T]`` rotate exactly as
    ``QKNormRotary``, and so do ``[3, T]`` whose axes agree: each token's row of the table is
    assembled from the rows at its three positions, then handed to the same ``qk_norm_rope``
    op as a per-token table (row ``t`` for token ``t``)."""

    def __init__(self, head_dim: int, rotary_dim: int, max_positions: int, theta: float,
                 kernels: Kernels, mrope_section: list[int], interleaved: bool = True):
        super().__init__(head_dim, rotary_dim, max_positions, theta, kernels)
        self.column_axes = mrope_axes(list(mrope_section), rotary_dim // 2, interleaved) * 2
        self.register_buffer("column_axis", torch.empty(rotary_dim, dtype=torch.int64),
                             persistent=False)  # [R]: the axis each [cos | sin] column reads

    def reset_derived_buffers(self) -> None:
        super().reset_derived_buffers()
        self.column_axis.copy_(torch.tensor(self.column_axes))

    def table(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions [T]`` or ``[3, T]``; otherwise as ``QKNormRotary.table``."""
        if positions.dim() == 1:
            return super().table(positions)
        rows = self.cos_sin[positions]  # [3, T, R]
        index = self.column_axis.expand(1, rows.shape[1], -1)  # [1, T, R]
        cos_sin = rows.gather(0, index)[0]  # [T, R]: each column from its axis' position
        return cos_sin, torch.arange(cos_sin.shape[0], device=cos_sin.device)
