"""BlockManager: allocation, release, reference counts and prefix-cache reuse."""

from __future__ import annotations

from qllm.batch import Sequence
from qllm.cache.block_manager import BlockManager
from qllm.config import SamplingParams

BS = 4


def seq_of(tokens) -> Sequence:
    return Sequence(list(tokens), SamplingParams())


def computed(manager: BlockManager, seq: Sequence, n: int) -> None:
    """Reserve and mark ``n`` more tokens of ``seq`` as computed, as a step would."""
    assert manager.reserve(seq, n)
    seq.num_computed_tokens += n
    manager.register_computed(seq)


def test_reserve_allocates_whole_blocks_and_release_frees_them():
    manager = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    seq = seq_of(range(10))
    manager.admit(seq)
    assert manager.reserve(seq, 10)
    assert len(manager.block_table(seq)) == 3 and manager.num_free_blocks == 5
    assert manager.reserve(seq, 2)  # still fits in the third block
    assert len(manager.block_table(seq)) == 3
    manager.release(seq)
    assert manager.num_free_blocks == 8 and manager.block_table(seq) == []


def test_reserve_refuses_without_changing_anything():
    manager = BlockManager(num_blocks=2, block_size=BS, enable_prefix_caching=False)
    seq = seq_of(range(12))
    manager.admit(seq)
    assert not manager.reserve(seq, 12)
    assert manager.block_table(seq) == [] and manager.num_free_blocks == 2


def test_prefix_hit_reuses_blocks_and_counts_references():
    manager = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=True)
    first = seq_of(range(10))
    manager.admit(first)
    computed(manager, first, 10)
    second = seq_of(list(range(8)) + [99, 98, 97])
    assert manager.admit(second) == 8
    assert manager.block_table(second) == manager.block_table(first)[:2]
    assert all(manager.blocks[b].ref_count == 2 for b in manager.block_table(second))
    manager.release(first)
    assert all(manager.blocks[b].ref_count == 1 for b in manager.block_table(second))
    manager.release(second)
    assert manager.num_free_blocks == 8


def test_freed_blocks_stay_cached_until_reused():
    manager = BlockManager(num_blocks=4, block_size=BS, enable_prefix_caching=True)
    first = seq_of(range(9))
    manager.admit(first)
    computed(manager, first, 9)
    manager.release(first)
    again = seq_of(range(9))
    assert manager.admit(again) == 8
    manager.release(again)
    # Filling the pool with other tokens evicts the cached blocks.
    other = seq_of(range(100, 116))
    manager.admit(other)
    computed(manager, other, 16)
    manager.release(other)
    late = seq_of(range(9))
    assert manager.admit(late) == 0


def test_a_fully_cached_prompt_still_computes_its_last_token():
    manager = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=True)
    first = seq_of(range(8))
    manager.admit(first)
    computed(manager, first, 8)
    second = seq_of(range(8))
    assert manager.admit(second) == 4  # the last block is recomputed for its last token


def test_same_hash_different_tokens_is_not_a_hit(monkeypatch):
    import qllm.cache.block_manager as bm

    monkeypatch.setattr(bm, "chain_hash", lambda parent, tokens: 42)  # every block collides
    manager = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=True)
    first = seq_of(range(9))
    manager.admit(first)
    computed(manager, first, 9)
    other = seq_of(range(50, 59))
    assert manager.admit(other) == 0
