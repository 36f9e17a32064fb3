"""Paged-KV block bookkeeping: allocation, reference counts and prefix caching by block hash."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

from qllm.batch import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = field(default_factory=tuple)


def chain_hash(parent: int | None, token_ids: tuple[int, ...]) -> int:
    """Hash of a full block given the hash of the block before it (the whole prefix counts)."""
    return hash((parent, token_ids))


class BlockManager:
    """Hands out fixed-size KV blocks to sequences.

    A full, computed block is registered under the hash of its tokens and every token before
    it. When its last user releases it, it stays in the free pool with its contents until the
    pool needs it, so a later sequence with the same prefix can take it back (a prefix-cache
    hit). Hits are checked against the stored tokens, so a hash collision can never alias.
    Each sequence's block table (its block ids in token order) is kept here, by ``seq_id``.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.tables: dict[int, list[int]] = {}  # seq_id -> block ids, in token order
        # called with each block hash that stops being cached (its block reused or reset)
        self.on_forget: Callable[[int], None] | None = None

    def block_table(self, seq: Sequence) -> list[int]:
        """The blocks ``seq`` holds, in token order (empty when it holds none)."""
        return self.tables.get(seq.seq_id, [])

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _take_free(self, block_id: int | None = None) -> Block:
        if block_id is None:
            block_id, _ = self.free.popitem(last=False)  # least recently freed first
        else:
            del self.free[block_id]
        return self.blocks[block_id]

    def admit(self, seq: Sequence) -> int:
        """Reuse cached blocks for the longest cached prefix of ``seq`` (always leaving at least
        one token to compute); returns the tokens they hold."""
        assert not self.tables.get(seq.seq_id), f"{seq} already holds blocks"
        table = self.tables[seq.seq_id] = []
        cacheable = (len(seq) - 1) // self.block_size * self.block_size
        if getattr(seq, "multimodal", None) is not None and seq.multimodal.items:
            # media placeholders are the same tokens for any image or audio: only the blocks
            # before the first may be shared (later ones are never hit, since a prompt
            # without media holds no placeholder)
            first = seq.multimodal.first_placeholder
            cacheable = min(cacheable, first // self.block_size * self.block_size)
        if seq.prompt_logprobs is not None and len(seq.prompt_logprobs) < seq.num_prompt_tokens:
            cacheable = 0  # its prompt log-probs need the logits of every prompt position
        parent = None
        for start in range(0, cacheable if self.enable_prefix_caching else 0, self.block_size):
            tokens = tuple(seq.token_ids[start:start + self.block_size])
            block_id = self.cached.get(chain_hash(parent, tokens))
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            block = self.blocks[block_id]
            if block.ref_count == 0:
                self._take_free(block_id)
            block.ref_count += 1
            table.append(block_id)
            parent = block.hash
        return len(table) * self.block_size

    def reserve(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make room for ``num_new_tokens`` more computed tokens; False (and no change) if the
        pool lacks the blocks."""
        table = self.tables.get(seq.seq_id)
        if table is None:  # reserved for without admission (tests, benchmarks)
            table = self.tables[seq.seq_id] = []
        # blocks_needed inlined: this runs for every sequence of every step
        missing = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size) - len(table)
        if missing <= 0:  # most decode steps: the last block has room
            return True
        if missing > len(self.free):
            return False
        for _ in range(missing):
            block = self._take_free()
            self._forget(block)
            block.ref_count = 1
            table.append(block.block_id)
        return True

    def _forget(self, block: Block) -> None:
        if block.hash is not None and self.cached.get(block.hash) == block.block_id:
            del self.cached[block.hash]
            if self.on_forget is not None:
                self.on_forget(block.hash)
        block.hash = None
        block.token_ids = ()

    def reset_prefix_cache(self) -> None:
        """Forget the hashes of every free block: no later prompt will hit them."""
        for block_id in self.free:
            self._forget(self.blocks[block_id])

    def register_computed(self, seq: Sequence) -> None:
        """Register the hashes of ``seq``'s blocks that became full and computed (of known
        tokens: a pending token's block waits until its value lands)."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens, len(seq.token_ids)) // self.block_size
        table = self.block_table(seq)
        parent = None
        for index in range(num_full):
            block = self.blocks[table[index]]
            if block.hash is None:
                start = index * self.block_size
                tokens = tuple(seq.token_ids[start:start + self.block_size])
                block_hash = chain_hash(parent, tokens)
                if block_hash in self.cached:  # another sequence computed the same block:
                    parent = block_hash  # that one stays cached; the chain goes on
                    continue
                block.hash, block.token_ids = block_hash, tokens
                self.cached[block_hash] = block.block_id
            parent = block.hash

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Keep only the blocks of ``seq``'s first ``num_tokens`` tokens (a block boundary),
        giving back the rest as ``release`` does (cached blocks stay cached)."""
        table = self.tables.get(seq.seq_id, [])
        keep = num_tokens // self.block_size
        self._drop(table[keep:])
        del table[keep:]

    def release(self, seq: Sequence) -> None:
        """Drop ``seq``'s references; blocks nobody holds go back to the free pool."""
        self._drop(self.tables.pop(seq.seq_id, ()))

    def _drop(self, block_ids) -> None:
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} released twice"
            if block.ref_count == 0:
                self.free[block_id] = None
                if block.hash is None:  # nothing worth keeping: hand it out first
                    self.free.move_to_end(block_id, last=False)
