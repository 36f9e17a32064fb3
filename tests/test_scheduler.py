"""Scheduler: FCFS admission, token budget, chunked prefill, decode and preemption, and the
lifecycle it alone moves sequences through (admission from a prefix hit, launch, tokens
applied, stops, tokens dropped after an abort)."""

from __future__ import annotations

import torch

from qllm.batch import Sequence, SequenceStatus
from qllm.cache.base import CacheRequirement
from qllm.cache.paged_kv import PagedKVPool
from qllm.config import EngineConfig, SamplingParams
from qllm.engine.scheduler import Scheduler


class FakeAttention(torch.nn.Module):
    layer_kind = "full_attention"

    def cache_requirement(self):
        return CacheRequirement("full_attention", {"k": (1, 2), "v": (1, 2)},
                                {"k": torch.float32, "v": torch.float32})

    def attach_cache(self, tensors):
        self.tensors = tensors


class FakeRegistry:
    """The cache registry's interface over one paged pool (its prefix hits taken whole)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        self.pool = PagedKVPool([FakeAttention()], num_blocks, torch.device("cpu"), block_size,
                                enable_prefix_caching=enable_prefix_caching)

    def admit(self, seq):
        return self.pool.cached_prefix_len(seq) if self.pool.admit(seq) else None

    def reserve(self, seq, n):
        return self.pool.reserve(seq, n)

    def register_computed(self, seq):
        self.pool.register_computed(seq)

    def release(self, seq):
        self.pool.release(seq)


def make(num_blocks=16, block_size=4, enable_prefix_caching=False, **options):
    config = EngineConfig(model="unused", block_size=block_size, max_model_len=64, **options)
    cache = FakeRegistry(num_blocks, block_size, enable_prefix_caching)
    return Scheduler(config, cache), cache


EOS = 0


def sampled(batch):
    """The sequences of ``batch`` that sample a token (every position then computed), as
    the runner picks them."""
    return [seq for seq, n in zip(batch.seqs, batch.num_tokens)
            if seq.num_computed_tokens + n == len(seq)]


def run_step(scheduler, batch, next_token=7):
    """Launch ``batch`` and apply its tokens, as the engine does without async scheduling:
    each sequence that samples gets ``next_token``. Returns the sequences that advanced."""
    seqs = sampled(batch)
    scheduler.launched(batch, seqs)
    return scheduler.postprocess(batch, seqs, [next_token] * len(seqs), {EOS})


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


def test_admission_starts_from_the_prefix_hit_the_cache_reports():
    scheduler, _ = make(enable_prefix_caching=True)
    first = Sequence(list(range(10)), SamplingParams())
    scheduler.add(first)
    run_step(scheduler, scheduler.schedule())  # computes and registers its two full blocks
    second = Sequence(list(range(8)) + [50, 51], SamplingParams())
    scheduler.add(second)
    batch = scheduler.schedule()
    assert batch.is_prefill and batch.seqs == [second] and batch.num_tokens == [2]
    assert second.num_computed_tokens == second.num_cached_tokens == 8
    assert second.status == SequenceStatus.RUNNING


def test_a_request_finished_by_its_first_token_leaves_its_prompt_cached():
    """A prompt served with max_tokens=1 finishes in the step that computed it; its full
    blocks are registered before they are freed, so the next prompt sharing them hits."""
    scheduler, _ = make(enable_prefix_caching=True)
    first = Sequence(list(range(10)), SamplingParams(max_tokens=1, ignore_eos=True))
    scheduler.add(first)
    run_step(scheduler, scheduler.schedule())
    assert first.is_finished
    second = Sequence(list(range(8)) + [50, 51], SamplingParams())
    scheduler.add(second)
    scheduler.schedule()
    assert second.num_cached_tokens == 8


def test_launch_computes_tokens_and_postprocess_appends_the_pending_ones():
    scheduler, _ = make(enable_chunked_prefill=True, max_num_batched_tokens=4)
    seq = Sequence([1] * 6, SamplingParams(max_tokens=2, ignore_eos=True))
    scheduler.add(seq)
    batch = scheduler.schedule()
    scheduler.launched(batch, sampled(batch))  # a chunk of 4: nothing sampled yet
    assert seq.num_computed_tokens == 4 and seq.num_pending_tokens == 0
    assert scheduler.postprocess(batch, [], [], {EOS}) == []
    batch = scheduler.schedule()
    scheduler.launched(batch, [seq])
    assert seq.num_computed_tokens == 6 and seq.num_pending_tokens == 1 and len(seq) == 7
    assert scheduler.postprocess(batch, [seq], [EOS], {EOS}) == [seq]
    assert seq.output_token_ids == [EOS] and seq.num_pending_tokens == 0
    assert seq.status == SequenceStatus.RUNNING  # EOS ignored
    assert run_step(scheduler, scheduler.schedule(), next_token=9) == [seq]
    assert seq.finish_reason == "length" and seq.output_token_ids == [EOS, 9]
    assert seq.num_computed_tokens == 0 and scheduler.running == []


def test_postprocess_stops_on_eos_and_frees_the_cache():
    scheduler, cache = make()
    seq = Sequence([1] * 5, SamplingParams(max_tokens=8))
    scheduler.add(seq)
    run_step(scheduler, scheduler.schedule())
    assert run_step(scheduler, scheduler.schedule(), next_token=EOS) == [seq]
    assert seq.is_finished and seq.finish_reason == "stop"
    assert cache.pool.num_free_units == cache.pool.num_units
    assert not scheduler.has_unfinished()


def test_a_token_pending_when_its_sequence_is_aborted_is_dropped():
    """With async scheduling the next batch launches before this one's tokens land; a
    sequence aborted in between keeps neither token."""
    scheduler, _ = make()
    seq = Sequence([1] * 5, SamplingParams(max_tokens=8))
    scheduler.add(seq)
    run_step(scheduler, scheduler.schedule())
    batch = scheduler.schedule()
    scheduler.launched(batch, [seq])
    scheduler.finish(seq, "abort")
    assert scheduler.postprocess(batch, [seq], [7], {EOS}) == []
    assert seq.output_token_ids == [7] and seq.num_pending_tokens == 0
    assert seq.finish_reason == "abort"
