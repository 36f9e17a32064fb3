"""Scheduler: FCFS admission, token budget, chunked prefill, decode and preemption."""

from __future__ import annotations

import torch

from qllm.cache.paged_kv import PagedKVPool
from qllm.config import EngineConfig, SamplingParams
from qllm.engine.scheduler import Scheduler
from qllm.engine.sequence import Sequence, SequenceStatus
from qllm.specs import CacheRequirement


class FakeAttention(torch.nn.Module):
    layer_kind = "full_attention"

    def cache_requirement(self):
        return CacheRequirement("full_attention", {"k": (1, 2), "v": (1, 2)},
                                {"k": torch.float32, "v": torch.float32})

    def attach_cache(self, tensors):
        self.tensors = tensors


class FakeRegistry:
    """The cache registry's interface over one paged pool."""

    def __init__(self, num_blocks: int, block_size: int):
        self.pool = PagedKVPool([FakeAttention()], num_blocks, torch.device("cpu"), block_size,
                                enable_prefix_caching=False)

    def admit(self, seq):
        return self.pool.admit(seq)

    def reserve(self, seq, n):
        return self.pool.reserve(seq, n)

    def limit_chunk(self, seq, n):
        return self.pool.limit_chunk(seq, n)

    def release(self, seq):
        self.pool.release(seq)
        seq.num_computed_tokens = 0


def make(num_blocks=16, block_size=4, **options):
    config = EngineConfig(model="unused", block_size=block_size, **options)
    cache = FakeRegistry(num_blocks, block_size)
    return Scheduler(config, cache), cache


def run_step(scheduler, batch, next_token=7):
    """Apply a step's effect as the engine would: tokens computed, one sampled when complete."""
    for seq, n in zip(batch.seqs, batch.num_tokens):
        seq.num_computed_tokens += n
        if seq.num_computed_tokens == len(seq):
            seq.append_token(next_token)


def test_prefill_is_fcfs_within_the_token_budget():
    scheduler, _ = make(max_num_batched_tokens=10, enable_chunked_prefill=False)
    seqs = [Sequence([1] * n, SamplingParams()) for n in (4, 5, 3)]
    for seq in seqs:
        scheduler.add(seq)
    batch = scheduler.schedule()
    assert batch.is_prefill and batch.seqs == seqs[:2] and batch.num_tokens == [4, 5]
    run_step(scheduler, batch)
    batch = scheduler.schedule()
    assert batch.is_prefill and batch.seqs == [seqs[2]]


def test_chunked_prefill_splits_a_long_prompt():
    scheduler, _ = make(max_num_batched_tokens=8)
    seq = Sequence([1] * 20, SamplingParams())
    scheduler.add(seq)
    chunks = []
    while seq.num_output_tokens == 0:
        batch = scheduler.schedule()
        assert batch.is_prefill
        chunks.append(batch.num_tokens[0])
        run_step(scheduler, batch)
    assert chunks == [8, 8, 4]
    batch = scheduler.schedule()
    assert not batch.is_prefill and batch.num_tokens == [1]


def test_max_num_seqs_caps_the_running_set():
    scheduler, _ = make(max_num_seqs=2)
    for _ in range(3):
        scheduler.add(Sequence([1, 2], SamplingParams()))
    batch = scheduler.schedule()
    assert len(batch) == 2 and len(scheduler.waiting) == 1


def test_decode_preempts_the_latest_sequence_when_blocks_run_out():
    scheduler, cache = make(num_blocks=3, block_size=4)
    first, second = Sequence([1] * 4, SamplingParams()), Sequence([2] * 4, SamplingParams())
    scheduler.add(first)
    scheduler.add(second)
    run_step(scheduler, scheduler.schedule())  # both prefilled: 2 blocks held, 1 free
    batch = scheduler.schedule()  # each needs a second block: only one is left
    assert batch.seqs == [first]
    assert second.status == SequenceStatus.WAITING and scheduler.waiting[0] is second
    assert cache.pool.block_table(second) == [] and second.num_computed_tokens == 0
    assert scheduler.num_preemptions == 1
    assert second.token_ids == [2] * 4 + [7]  # its generated token is kept for recompute


def test_finish_frees_the_cache():
    scheduler, cache = make()
    seq = Sequence([1] * 6, SamplingParams())
    scheduler.add(seq)
    run_step(scheduler, scheduler.schedule())
    scheduler.finish(seq, "stop")
    assert seq.is_finished and cache.pool.num_free_units == cache.pool.num_units
    assert scheduler.schedule() is None
