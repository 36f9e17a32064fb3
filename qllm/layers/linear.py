"""Linear layers that keep HF parameter names, including packed (fused) projections."""

from __future__ import annotations

import torch
from torch import nn


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    """Copy a checkpoint tensor into ``param``, converting dtype; shapes must match."""
    if param.shape != loaded.shape:
        raise ValueError(f"shape {tuple(loaded.shape)} does not match the model's "
                         f"{tuple(param.shape)}")
    param.data.copy_(loaded)


class PackedLinear(nn.Linear):
    """Several HF projections of one input fused into one matmul, e.g. q/k/v or gate/up.

    ``shard_sizes`` maps each HF projection's shard name to its output rows, in order;
    ``weight_loader(param, tensor, shard)`` places one checkpoint tensor into its rows (the
    loader calls a module's ``weight_loader`` for the parameters it owns).
    """

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool = False):
        super().__init__(in_features, sum(shard_sizes.values()), bias=bias)
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, size in shard_sizes.items():
            self.shard_offsets[name] = (offset, size)
            offset += size

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str) -> None:
        offset, size = self.shard_offsets[shard]
        default_weight_loader(param.data.narrow(0, offset, size), loaded)

    def split(self, out: torch.Tensor) -> list[torch.Tensor]:
        """Split a ``[T, out_features]`` result into the shards, in order."""
        return list(out.split([size for _, size in self.shard_offsets.values()], dim=-1))
