"""Linear layers that keep HF parameter names, including packed (fused) projections; their
matmul is the ``linear`` op chosen for the model (``qllm.ops.linear`` or a kernel plugin)."""

from __future__ import annotations

import torch
from torch import nn

from qllm.distributed.parallel_state import TensorParallel, all_reduce, get_tp
from qllm.distributed.shards import materialize, narrow_part
from qllm.plugins.registry import Kernels


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    """Copy a checkpoint tensor (or a ``qllm.distributed.shards.CheckpointSlice`` of one) into
    ``param``, converting dtype; shapes must match."""
    if param.shape != loaded.shape:
        raise ValueError(f"shape {tuple(loaded.shape)} does not match the model's "
                         f"{tuple(param.shape)}")
    param.data.copy_(materialize(loaded))


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
                 bias: bool = False, row_multiple: int = 1,
                 shard_parts: dict[str, tuple[int, int]] | None = None):
        rows = sum(shard_sizes.values())
        super().__init__(in_features, -(-rows // row_multiple) * row_multiple, kernels,
                         bias=bias)
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, size in shard_sizes.items():
            self.shard_offsets[name] = (offset, size)
            offset += size
        # tensor parallelism: shard -> (parts, index): the checkpoint tensor's rows split in
        # `parts` equal parts, of which this rank's rows are part `index`
        self.shard_parts = shard_parts or {}

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str) -> None:
        offset, size = self.shard_offsets[shard]
        if shard in self.shard_parts:
            loaded = narrow_part(loaded, 0, *self.shard_parts[shard])
        default_weight_loader(param.data.narrow(0, offset, size), loaded)

    def split(self, out: torch.Tensor) -> list[torch.Tensor]:
        """Split a ``[T, out_features]`` result into the shards, in order (views)."""
        return [out.narrow(-1, offset, size) for offset, size in self.shard_offsets.values()]


def column_parts(tp: TensorParallel, names) -> dict[str, tuple[int, int]]:
    """``PackedLinear.shard_parts`` of shards split evenly over the ranks (column parallel)."""
    return {name: (tp.size, tp.rank) for name in names} if tp.size > 1 else {}


class RowParallelLinear(Linear):
    """``Linear`` whose input columns are split over the tensor-parallel ranks: each rank
    multiplies its slice of the input (the output of a column-parallel layer) and the partial
    results are summed by one all-reduce; the bias is added once, after it. ``reduce=False``
    leaves the partial sum to the caller (a block that reduces several outputs at once). At
    size 1, exactly the plain ``Linear``: no collective is called."""

    def __init__(self, in_features: int, out_features: int, kernels: Kernels,
                 bias: bool = False, tp: TensorParallel | None = None, reduce: bool = True):
        self.tp = tp or get_tp()
        if bias and not reduce and self.tp.size > 1:
            raise ValueError("a row-parallel projection with a bias must reduce its output")
        super().__init__(self.tp.shard(in_features, "the input features of a row-parallel "
                                       "projection"), out_features, kernels, bias=bias)
        self.reduce = reduce

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if param.dim() == 2:  # the bias is whole on every rank
            loaded = narrow_part(loaded, 1, self.tp.size, self.tp.rank)
        default_weight_loader(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., in_features / size]`` -> ``[..., out_features]``, summed over the ranks."""
        if self.tp.size == 1:
            return self._linear(x, self.weight, self.bias)
        out = self._linear(x, self.weight, None)
        if self.reduce:
            out = all_reduce(out, self.tp)
        return out if self.bias is None else out + self.bias
