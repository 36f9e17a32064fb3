"""Recurrent-state checkpoints for exact prefix caching of hybrid models: which storage row
holds the state after which cached prefix, with LRU eviction.

A checkpoint is the state of every recurrent layer (conv and SSM state) after the first ``b``
tokens of some sequence, ``b`` a KV block boundary. Checkpoints are kept where prefixes are
shared, not on a grid: a sequence wants one at its *branch point*, the end of its cached KV
prefix, when that prefix reaches past the last checkpoint it could restore (``want``): the KV
blocks there were computed by another sequence, so the prefix is shared, and the next
sequence sharing it restores the state instead of recomputing it. A prompt that shares
nothing saves nothing (no workload without shared prefixes pays for the cache), and each
shared prefix is recomputed once more than with a checkpoint at every block, by the sequence
that first finds it shared; sequences that find it shared while that one is still on its way
there wait for its checkpoint rather than recompute the prefix too (``pending``).

A checkpoint is keyed by the chain hash of the KV block that ends at ``b``
(``block_manager.chain_hash``, the hash the paged-KV prefix cache registers that block under)
and checked against that block's tokens, as the block manager checks its hits. It is usable
only while the KV blocks of its prefix are cached: a hit needs the KV hit to reach ``b``, and
the registry drops a checkpoint when its block's hash leaves the KV cache (``forget``). This
class keeps only the bookkeeping; ``RecurrentSlotPool`` owns the tensors and does the copies.
"""

from __future__ import annotations

from collections import OrderedDict

from qllm.batch import Sequence
from qllm.cache.block_manager import chain_hash


class StateCheckpoints:
    """``num_rows`` checkpoint rows, numbered from ``first_row`` in the state storage."""

    def __init__(self, first_row: int, num_rows: int, block_size: int):
        self.block_size = block_size
        self.num_rows = num_rows
        self.free_rows = list(range(first_row + num_rows - 1, first_row - 1, -1))
        # block hash -> (row, tokens of that block), least recently used first
        self.entries: OrderedDict[int, tuple[int, tuple[int, ...]]] = OrderedDict()
        self._hashes: dict[int, list[int]] = {}  # seq_id -> chain hashes of its full blocks
        self._wanted: dict[int, int] = {}  # seq_id -> its branch point (``want``)
        # block hash of a wanted branch point -> the sequence that will save it
        self._savers: dict[int, Sequence] = {}
        self.num_saved = 0
        self.num_restored = 0
        self.num_evicted = 0  # dropped for room (LRU) or because their KV blocks left

    # ------------------------------------------------------------------ hashes
    def block_hash(self, seq: Sequence, num_tokens: int) -> int:
        """Chain hash of ``seq``'s block that ends at token ``num_tokens`` (a boundary of
        known tokens), cached per sequence (tokens are only ever appended)."""
        chain = self._hashes.setdefault(seq.seq_id, [])
        bs = self.block_size
        while len(chain) < num_tokens // bs:
            start = len(chain) * bs
            chain.append(chain_hash(chain[-1] if chain else None,
                                    tuple(seq.token_ids[start:start + bs])))
        return chain[num_tokens // bs - 1]

    def forget_sequence(self, seq: Sequence) -> None:
        wanted = self._wanted.pop(seq.seq_id, None)
        if wanted is not None:
            key = self.block_hash(seq, wanted)
            if self._savers.get(key) is seq:
                del self._savers[key]
        self._hashes.pop(seq.seq_id, None)

    def want(self, seq: Sequence, num_tokens: int) -> None:
        """``seq`` (just admitted) recomputes its first ``num_tokens`` tokens, a prefix the KV
        cache holds (a block boundary past any checkpoint it could restore): keep the state
        after them when it passes there."""
        self._wanted[seq.seq_id] = num_tokens
        self._savers.setdefault(self.block_hash(seq, num_tokens), seq)

    def pending(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether another sequence, not yet past there, will save the checkpoint after
        ``seq``'s first ``num_tokens`` tokens (the same prefix: the same block hash)."""
        saver = self._savers.get(self.block_hash(seq, num_tokens))
        return saver is not None and saver is not seq and saver.num_computed_tokens < num_tokens

    def wanted(self, seq: Sequence) -> int | None:
        """The boundary after which ``seq`` keeps a checkpoint (``want``), or None."""
        return self._wanted.get(seq.seq_id)

    # ------------------------------------------------------------------ entries
    def _tokens(self, seq: Sequence, num_tokens: int) -> tuple[int, ...]:
        return tuple(seq.token_ids[num_tokens - self.block_size:num_tokens])

    def find(self, seq: Sequence, num_tokens: int) -> int | None:
        """The row of the checkpoint after ``seq``'s first ``num_tokens`` tokens, or None."""
        entry = self.entries.get(self.block_hash(seq, num_tokens))
        if entry is None or entry[1] != self._tokens(seq, num_tokens):
            return None
        return entry[0]

    def touch(self, seq: Sequence, num_tokens: int) -> None:
        self.entries.move_to_end(self.block_hash(seq, num_tokens))

    def add(self, seq: Sequence, num_tokens: int) -> int | None:
        """A row for a new checkpoint after ``seq``'s first ``num_tokens`` tokens (the least
        recently used one evicted when none is free); None when one exists already."""
        key = self.block_hash(seq, num_tokens)
        if key in self.entries:
            self.entries.move_to_end(key)
            return None
        if not self.free_rows:
            _, (row, _) = self.entries.popitem(last=False)
            self.free_rows.append(row)
            self.num_evicted += 1
        row = self.free_rows.pop()
        self._savers.pop(key, None)
        self.entries[key] = (row, self._tokens(seq, num_tokens))
        self.num_saved += 1
        return row

    def forget(self, block_hash: int) -> None:
        """Drop the checkpoint of ``block_hash`` (its KV block is no longer cached)."""
        entry = self.entries.pop(block_hash, None)
        if entry is not None:
            self.free_rows.append(entry[0])
            self.num_evicted += 1

    def clear(self) -> None:
        for block_hash in list(self.entries):
            self.free_rows.append(self.entries.pop(block_hash)[0])
