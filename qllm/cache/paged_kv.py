"""The ``paged_kv`` cache kind: per-layer K/V pages of ``block_size`` tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qllm.batch import Sequence
from qllm.cache.base import CachePool, StepFields
from qllm.cache.block_manager import BlockManager


def bytes_per_block(layers: list, block_size: int) -> int:
    """Memory of one block across every layer that keeps K/V pages."""
    return block_size * sum(r.bytes_per_entry() for r in CachePool.requirements(layers))


@dataclass
class PagedKVBatch:
    """``paged_kv``'s fields of one step, ``ForwardBatch.caches["paged_kv"]``. Token ``p`` of
    sequence ``i`` lives at offset ``p % block_size`` of block ``block_tables[i, p //
    block_size]``, flat entry ``block * block_size + offset``; a padded row's table is all
    padding block."""

    block_tables: torch.Tensor  # [B, W] int32, blocks per sequence, padded with the padding one
    slot_mapping: torch.Tensor  # [T] int64, flat K/V entry of each new token


class PagedKVPool(CachePool):
    """K/V pages for every full-attention layer, shaped ``[num_blocks + 1, block_size, ...]``.

    Block ``num_blocks`` (the last, ``padding_unit``) belongs to nobody: padded rows of a
    CUDA-graph batch write their K/V there, so padding never touches a live block.
    """

    name = "paged_kv"
    supports_prefix_caching = True
    unit_name = "block"
    batch_type = PagedKVBatch

    def __init__(self, layers: list, num_units: int, device: torch.device, block_size: int,
                 enable_prefix_caching: bool):
        super().__init__(layers, num_units, device)
        self.block_size = block_size
        self.manager = BlockManager(num_units, block_size, enable_prefix_caching)
        self.manager.on_forget = self._forgotten
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

    def set_prefix_caching(self, enabled: bool) -> None:
        self.manager.enable_prefix_caching = enabled

    def reset_prefix_cache(self) -> None:
        self.manager.reset_prefix_cache()

    def cached_prefix_len(self, seq: Sequence) -> int:
        """The tokens of the cached blocks ``admit`` took (all ``seq`` holds until it
        reserves)."""
        return len(self.manager.block_table(seq)) * self.block_size

    def take_prefix(self, seq: Sequence, num_tokens: int, cached_tokens: int) -> None:
        self.manager.truncate(seq, num_tokens)  # the blocks past it are recomputed

    def _forgotten(self, block_hash: int) -> None:
        if self.on_forget_prefix is not None:
            self.on_forget_prefix(block_hash)

    def block_table(self, seq: Sequence) -> list[int]:
        """The blocks ``seq`` holds, in token order."""
        return self.manager.block_table(seq)

    @property
    def num_free_units(self) -> int:
        return self.manager.num_free_blocks

    def units_needed(self, num_tokens: int) -> int:
        return self.manager.blocks_needed(num_tokens)

    def step_fields(self, seqs: list[Sequence], context_lens: list[int], seq_lens: list[int],
                    num_padding: int = 0, max_model_len: int | None = None,
                    padding_len: int = 1, is_prefill: bool = False) -> StepFields:
        """``block_tables`` (``max_model_len``'s blocks wide, or the step's longest table's)
        and ``slot_mapping``; see ``PagedKVBatch``."""
        bs, padding, tables = self.block_size, self.padding_unit, self.manager.tables
        block_tables = [tables[seq.seq_id] for seq in seqs]
        slot_mapping = []
        for table, start, end in zip(block_tables, context_lens, seq_lens):
            if end - start == 1:  # every row of a decode step
                slot_mapping.append(table[start // bs] * bs + start % bs)
            else:
                slot_mapping += [table[pos // bs] * bs + pos % bs for pos in range(start, end)]
        # an inert row's tokens stay in the padding block (positions past it wrap around)
        slot_mapping += [padding * bs + pos % bs for pos in range(padding_len)] * num_padding
        width = self.manager.blocks_needed(max_model_len) if max_model_len else \
            max(1, max(map(len, block_tables), default=1))
        block_tables = [table + [padding] * (width - len(table)) for table in block_tables]
        block_tables += [[padding] * width] * num_padding
        return {"block_tables": (block_tables, torch.int32),
                "slot_mapping": (slot_mapping, torch.int64)}
