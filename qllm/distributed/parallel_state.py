"""This process's place in the tensor-parallel group.

Set while a rank builds its model (``building``) and read by the sharded layers when they are
constructed (``get_tp``): each layer keeps its rank, size and group as plain attributes, so
``forward`` reads no global (no torch.compile guard on it). Outside, it is the
single-process state, rank 0 of 1, in which ``all_reduce`` is never called.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TensorParallel:
    """``rank`` of ``size`` in the device process ``group`` (NCCL on CUDA, gloo on CPU);
    ``group_name`` names it for the functional collectives that torch.compile traces."""

    rank: int = 0
    size: int = 1
    group: object = None
    group_name: str | None = None

    def shard(self, total: int, what: str) -> int:
        """This rank's share of ``total`` (rows, heads, channels); ``ValueError`` naming
        ``what`` when the size does not divide it."""
        if total % self.size:
            raise ValueError(f"tensor_parallel_size={self.size} does not divide {what} "
                             f"({total})")
        return total // self.size

    def replicated_shard(self, heads: int, what: str) -> tuple[int, int, int]:
        """KV heads: ``(local heads, parts, part index)``. With fewer heads than ranks each
        head is replicated on ``size // heads`` ranks (``size`` must then be a multiple of
        ``heads``); otherwise the heads are split as any other dimension."""
        if heads >= self.size:
            return self.shard(heads, what), self.size, self.rank
        if self.size % heads:
            raise ValueError(f"tensor_parallel_size={self.size} is neither a divisor nor a "
                             f"multiple of {what} ({heads})")
        return 1, heads, self.rank * heads // self.size


_STATE = TensorParallel()


def get_tp() -> TensorParallel:
    """This process's tensor-parallel state (read at model build time, never in forward)."""
    return _STATE


@contextlib.contextmanager
def building(state: TensorParallel):
    """The state that sharded layers built inside see (a tensor-parallel rank builds its
    model shard inside; an engine of one process never enters it)."""
    global _STATE
    saved, _STATE = _STATE, state
    try:
        yield state
    finally:
        _STATE = saved


def all_reduce(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Sum ``x`` over the ranks of ``tp`` (a new tensor). Through the functional collectives,
    which torch.compile traces into the layer graph (``fullgraph``) and which a CUDA graph
    captures on NCCL. At size 1 it returns ``x``; callers skip it altogether there."""
    if tp.size == 1:
        return x
    out = torch.ops._c10d_functional.all_reduce(x, "sum", tp.group_name)
    return torch.ops._c10d_functional.wait_tensor(out)
