"""CPU-side hot paths at batch 256: scheduling, block allocation, batch-metadata build; and, on
CUDA, one decode step of the W1 model.

    pytest benchmarks/ --benchmark-autosave          # save a baseline
    pytest benchmarks/ --benchmark-compare --benchmark-compare-fail=median:10%
"""

from __future__ import annotations

import random

import pytest
import torch

from qllm.batch import Sequence
from qllm.cache.block_manager import BlockManager
from qllm.config import SamplingParams

BATCH = 256


def w1_like_sequences(block_size: int = 256) -> list[Sequence]:
    rng = random.Random(0)
    return [Sequence([rng.randint(0, 10000) for _ in range(rng.randint(100, 1024))],
                     SamplingParams(max_tokens=512)) for _ in range(BATCH)]


def test_block_allocation_and_release(benchmark):
    seqs = w1_like_sequences()
    manager = BlockManager(num_blocks=BATCH * 8, block_size=256, enable_prefix_caching=True)

    def allocate_and_release():
        for seq in seqs:  # from the cached prefix (num_computed_tokens) to the end
            seq.num_computed_tokens = manager.admit(seq)
            manager.reserve(seq, len(seq) - seq.num_computed_tokens)
        for seq in seqs:
            manager.release(seq)
            seq.num_computed_tokens = 0

    benchmark(allocate_and_release)
    assert manager.num_free_blocks == manager.num_blocks


@pytest.fixture(scope="module")
def decode_engine(tmp_path_factory):
    """An engine on a tiny model with 256 running sequences, ready to decode. Scheduling is
    synchronous, so every input token is on the host when a step's metadata is built."""
    from qllm import LLM
    from qllm.testing import save_tiny_qwen3

    path = tmp_path_factory.mktemp("bench-qwen3")
    save_tiny_qwen3(path, max_position_embeddings=2048)
    llm = LLM(str(path), max_num_seqs=BATCH, max_model_len=2048, block_size=256,
              async_scheduling=False)
    engine = llm.engine
    for seq in w1_like_sequences():
        engine.add_request([t % 512 for t in seq.token_ids], SamplingParams(max_tokens=10_000,
                                                                            ignore_eos=True))
    prefill_all(engine)
    return engine


def test_decode_schedule(benchmark, decode_engine):
    scheduler = decode_engine.scheduler
    batch = benchmark(scheduler.schedule)
    assert not batch.is_prefill and len(batch) == BATCH


def test_decode_batch_metadata_build(benchmark, decode_engine):
    batch = decode_engine.scheduler.schedule()
    input_ids, _, forward_batch = benchmark(decode_engine.runner.prepare, batch)
    assert input_ids.shape == (BATCH,)
    assert forward_batch.caches["paged_kv"].block_tables.shape[0] == BATCH


def prefill_all(engine) -> None:
    while engine.scheduler.waiting or any(s.num_uncomputed_tokens > 1
                                          for s in engine.scheduler.running):
        engine.step()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_w1_decode_step_cuda(benchmark):
    """One whole W1 decode step (Qwen3-0.6B geometry, dummy weights, batch 256, ~600-token
    contexts): graph replay, sampling and the host sync included."""
    from qllm import LLM
    from workloads import QWEN3_0_6B, write_config

    llm = LLM(write_config(QWEN3_0_6B, None), load_format="dummy", dtype="bfloat16",
              max_num_seqs=BATCH, max_model_len=2048)
    engine = llm.engine
    for seq in w1_like_sequences():
        engine.add_request(seq.token_ids, SamplingParams(temperature=0.6, max_tokens=10_000,
                                                         ignore_eos=True))
    prefill_all(engine)
    advanced = benchmark(engine.step)
    assert len(advanced) == BATCH
