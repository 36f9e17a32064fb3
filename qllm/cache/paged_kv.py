"""The ``paged_kv`` cache kind: per-layer K/V pages of ``block_size`` tokens."""

from __future__ import annotations

import torch

from qllm.cache.base import CachePool
from qllm.cache.block_manager import BlockManager
from qllm.engine.sequence import Sequence


def bytes_per_block(layers: list, block_size: int) -> int:
    """Memory of one block across every layer that keeps K/V pages."""
    return block_size * sum(r.bytes_per_entry() for r in CachePool.requirements(layers))


class PagedKVPool(CachePool):
    """K/V pages for every full-attention layer, shaped ``[num_blocks + 1, block_size, ...]``.

    Block ``num_blocks`` (the last) belongs to nobody: padded rows of a CUDA-graph batch write
    their K/V there, so padding never touches a live block.
    """

    name = "paged_kv"
    supports_prefix_caching = True

    def __init__(self, layers: list, num_units: int, device: torch.device, block_size: int,
                 enable_prefix_caching: bool):
        super().__init__(layers, num_units, device)
        self.block_size = block_size
        self.padding_block = num_units
        self.manager = BlockManager(num_units, block_size, enable_prefix_caching)
        for layer, req in zip(layers, self.requirements(layers)):
            layer.attach_cache({
                key: torch.zeros((num_units + 1, block_size, *shape), dtype=req.dtypes[key],
                                 device=device)
                for key, shape in req.shapes.items()})

    def admit(self, seq: Sequence) -> bool:
        self.manager.admit(seq)
        return True

    def reserve(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.manager.reserve(seq, num_new_tokens)

    def register_computed(self, seq: Sequence) -> None:
        self.manager.register_computed(seq)

    def release(self, seq: Sequence) -> None:
        self.manager.release(seq)

    def reset_prefix_cache(self) -> None:
        self.manager.reset_prefix_cache()

    @property
    def num_free_units(self) -> int:
        return self.manager.num_free_blocks
