"""Linear layers that keep HF parameter names, including packed (fused) projections; their
matmul is the ``linear`` op chosen for the model (``qllm.ops.linear`` or a kernel plugin)."""

from __future__ import annotations

import torch
from torch import nn

from qllm.plugins import Kernels


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    """Copy a checkpoint tensor into ``param``, converting dtype; shapes must match."""
    if param.shape != loaded.shape:
        raise ValueError(f"shape {tuple(loaded.shape)} does not match the model's "
                         f"{tuple(param.shape)}")
    param.data.copy_(loaded)


class Linear(nn.Linear):
    """``nn.Linear`` (same ``weight [N, K]`` / ``bias [N]`` parameters, so checkpoints load
    unchanged) whose forward calls the ``linear`` kernel chosen when the model is built."""

    def __init__(self, in_features: int, out_features: int, kernels: Kernels,
                 bias: bool = False):
        super().__init__(in_features, out_features, bias=bias)
        self._linear = kernels.linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., in_features]`` -> ``[..., out_features]``."""
        return self._linear(x, self.weight, self.bias)


class PackedLinear(Linear):
    """Several HF projections of one input fused into one matmul, e.g. q/k/v or gate/up.

    ``shard_sizes`` maps each HF projection's shard name to its output rows, in order;
    ``weight_loader(param, tensor, shard)`` places one checkpoint tensor into its rows (the
    loader calls a module's ``weight_loader`` for the parameters it owns).

    ``row_multiple`` pads the output rows up to a multiple (unloaded rows after the shards,
    which ``split`` drops): with an odd total, e.g. 1,281, the output's rows are not 16-byte
    aligned and cuBLAS falls back to ``align1`` kernels (22 us instead of a few for the
    Qwen3.5 MoE input projection at batch 200 on the H200).
    """

    def __init__(self, in_features: int, shard_sizes: dict[str, int], kernels: Kernels,
                 bias: bool = False, row_multiple: int = 1):
        rows = sum(shard_sizes.values())
        super().__init__(in_features, -(-rows // row_multiple) * row_multiple, kernels,
                         bias=bias)
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, size in shard_sizes.items():
            self.shard_offsets[name] = (offset, size)
            offset += size

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str) -> None:
        offset, size = self.shard_offsets[shard]
        default_weight_loader(param.data.narrow(0, offset, size), loaded)

    def split(self, out: torch.Tensor) -> list[torch.Tensor]:
        """Split a ``[T, out_features]`` result into the shards, in order (views)."""
        return [out.narrow(-1, offset, size) for offset, size in self.shard_offsets.values()]
