"""The Qwen3.5 vision tower (``model.visual.*``, transformers' ``Qwen3_5VisionModel``): image
patches in, one embedding per merged patch out, of the text model's hidden size.

``pixel_values [N, C * Tp * P * P]`` (the image processor's flattened patches, grouped in
``spatial_merge_size``-square blocks) -> patch embedding (a Conv3d whose stride is its kernel,
i.e. one matmul per patch) + the learned position grid bilinearly resampled to each image's
grid -> ``depth`` pre-norm ViT blocks (bidirectional attention within each frame, 2-D rotary
over the patch's row and column) -> the merger (LayerNorm, then each merge block's
``merge**2`` patches concatenated through a GELU MLP) -> ``[N / merge**2, out_hidden_size]``.

Runs once per image at prefill, in plain torch (``F.scaled_dot_product_attention`` per frame);
the engine keeps its output with the request.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

ACTIVATIONS = {"gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
               "gelu": F.gelu, "silu": F.silu, "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x)}


class PatchEmbed(nn.Module):
    def __init__(self, in_channels: int, temporal_patch_size: int, patch_size: int, dim: int):
        super().__init__()
        kernel = (temporal_patch_size, patch_size, patch_size)
        self.proj = nn.Conv3d(in_channels, dim, kernel_size=kernel, stride=kernel, bias=True)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """``[N, C * Tp * P * P]`` -> ``[N, dim]``: the Conv3d over one patch is a matmul."""
        weight = self.proj.weight.flatten(1)  # [dim, C * Tp * P * P], the patches' layout
        return F.linear(patches.to(weight.dtype), weight, self.proj.bias)


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.proj = nn.Linear(dim, dim, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                frame_lens: list[int]) -> torch.Tensor:
        """``x [N, dim]``, ``cos``/``sin [N, head_dim]`` -> ``[N, dim]``; attention only within
        each frame (``frame_lens`` patches each)."""
        q, k, v = self.qkv(x).unflatten(-1, (3, self.num_heads, self.head_dim)).unbind(1)
        q, k = rotate_half_fp32(q, cos, sin), rotate_half_fp32(k, cos, sin)  # [N, h, d]
        out = [F.scaled_dot_product_attention(qs.transpose(0, 1), ks.transpose(0, 1),
                                              vs.transpose(0, 1)).transpose(0, 1)
               for qs, ks, vs in zip(q.split(frame_lens), k.split(frame_lens),
                                     v.split(frame_lens))]
        return self.proj(torch.cat(out).flatten(1))


def rotate_half_fp32(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX rotation of all of ``x [N, h, d]`` by ``cos``/``sin [N, d]``, computed in fp32."""
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str):
        super().__init__()
        self.linear_fc1 = nn.Linear(dim, hidden, bias=True)
        self.linear_fc2 = nn.Linear(hidden, dim, bias=True)
        self.act = ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.attn = VisionAttention(config.hidden_size, config.num_heads)
        self.mlp = VisionMLP(config.hidden_size, config.intermediate_size, config.hidden_act)

    def forward(self, x, cos, sin, frame_lens):
        x = x + self.attn(self.norm1(x), cos, sin, frame_lens)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """LayerNorm per patch, then each merge block's ``merge**2`` patches as one row through
    ``linear_fc1`` -> GELU -> ``linear_fc2`` (to the text hidden size)."""

    def __init__(self, dim: int, merge: int, out_dim: int):
        super().__init__()
        self.merged_dim = dim * merge * merge
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.merged_dim, self.merged_dim)
        self.linear_fc2 = nn.Linear(self.merged_dim, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x).view(-1, self.merged_dim)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class VisionEncoder(nn.Module):
    """``Qwen3_5VisionModel`` (and the identical ``Qwen3_5MoeVisionModel``), HF parameter
    names under ``visual.``. ``forward(pixel_values, grid_thw)`` -> merged patch embeddings."""

    def __init__(self, config):
        super().__init__()
        self.merge = config.spatial_merge_size
        self.hidden_size = config.hidden_size
        self.head_dim = config.hidden_size // config.num_heads
        self.out_hidden_size = config.out_hidden_size
        self.patch_embed = PatchEmbed(config.in_channels, config.temporal_patch_size,
                                      config.patch_size, config.hidden_size)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        self.grid_side = int(config.num_position_embeddings ** 0.5)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config.hidden_size, self.merge, config.out_hidden_size)
        params = getattr(config, "rope_parameters", None) or {}
        self.rope_theta = float(params.get("rope_theta", 10000.0))
        # 2-D rotary: head_dim / 4 frequencies per axis (rows, then columns)
        self.register_buffer("inv_freq", torch.empty(self.head_dim // 4), persistent=False)

    def reset_derived_buffers(self) -> None:
        spatial = self.head_dim // 2
        exponents = torch.arange(0, spatial, 2, dtype=torch.float, device=self.inv_freq.device)
        self.inv_freq.copy_(1.0 / (self.rope_theta ** (exponents / spatial)))

    def num_tokens(self, grid_thw: tuple[int, int, int]) -> int:
        """Embeddings one image (or video) of grid ``(t, h, w)`` patches yields."""
        t, h, w = grid_thw
        return t * h * w // (self.merge * self.merge)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """``pixel_values [N, C * Tp * P * P]``, ``grid_thw [I, 3]`` -> ``[N / merge**2,
        out_hidden_size]``, the images' embeddings one after the other."""
        grids = [tuple(g) for g in grid_thw.tolist()]
        x = self.patch_embed(pixel_values)  # [N, dim]
        x = x + self._position_embeddings(grids).to(x.dtype)
        rows, cols = self._patch_coordinates(grids, x.device)  # [N] each
        freqs = torch.cat([rows[:, None] * self.inv_freq, cols[:, None] * self.inv_freq], -1)
        angles = torch.cat([freqs, freqs], dim=-1)  # [N, head_dim], NeoX halves
        cos, sin = angles.cos(), angles.sin()
        frame_lens = [h * w for t, h, w in grids for _ in range(t)]
        for block in self.blocks:
            x = block(x, cos, sin, frame_lens)
        return self.merger(x)

    def _block_order(self, grid: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """``grid [h, w, ...]`` in raster order -> ``[h * w, ...]`` in merge-block order (the
        order of the processor's patches: block row, block column, row in block, column)."""
        m = self.merge
        blocks = grid.reshape(h // m, m, w // m, m, *grid.shape[2:]).transpose(1, 2)
        return blocks.reshape(h * w, *grid.shape[2:])

    def _patch_coordinates(self, grids, device) -> tuple[torch.Tensor, torch.Tensor]:
        rows, cols = [], []
        for t, h, w in grids:
            r, c = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device),
                                  indexing="ij")
            rows.append(self._block_order(r, h, w).repeat(t))
            cols.append(self._block_order(c, h, w).repeat(t))
        return torch.cat(rows).float(), torch.cat(cols).float()

    def _position_embeddings(self, grids) -> torch.Tensor:
        """The learned ``side x side`` position grid resampled to each image's ``h x w``
        (bilinear, corners aligned, as ``F.interpolate(align_corners=True)``), in merge-block
        order, repeated over the frames -> ``[N, dim]`` in fp32."""
        side, table = self.grid_side, self.pos_embed.weight.float()
        out = []
        for t, h, w in grids:
            (r0, r1), (wr0, wr1) = _axis_taps(h, side, table.device)
            (c0, c1), (wc0, wc1) = _axis_taps(w, side, table.device)
            corner = lambda r, c: table[(r[:, None] * side + c[None, :]).flatten()]  # noqa: E731
            weight = lambda a, b: (a[:, None] * b[None, :]).flatten()[:, None]  # noqa: E731
            grid = (corner(r0, c0) * weight(wr0, wc0) + corner(r0, c1) * weight(wr0, wc1)
                    + corner(r1, c0) * weight(wr1, wc0) + corner(r1, c1) * weight(wr1, wc1))
            out.append(self._block_order(grid.view(h, w, -1), h, w).repeat(t, 1))
        return torch.cat(out)


def _axis_taps(size: int, side: int, device) -> tuple[tuple[torch.Tensor, torch.Tensor],
                                                      tuple[torch.Tensor, torch.Tensor]]:
    """For ``size`` target positions on a ``side``-long source axis (corners aligned): the
    two source indices each reads and their weights."""
    src = torch.arange(size, device=device, dtype=torch.float32) * (side - 1) / max(size - 1, 1)
    floor = src.floor()
    frac = src - floor
    low = floor.long().clamp(0, side - 1)
    high = (floor.long() + 1).clamp(0, side - 1)
    return (low, high), (1 - frac, frac)
