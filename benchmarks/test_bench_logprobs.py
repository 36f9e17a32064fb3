"""Cost of log-probs and penalties per sampling step at W1's batch (256 rows) and vocabulary
(151,936), on CUDA when present, else on the CPU: what ``logprobs=5`` adds to a step's device
work (log_softmax, the sampled token's rank, top-5) and to the host (unpacking into dicts),
and what a batch with penalties adds (building the per-row token counts and applying them).

    pytest benchmarks/test_bench_logprobs.py

What it costs a whole run: ``python benchmarks/throughput.py --workload w1 --logprobs 5``
against the plain run.
"""

from __future__ import annotations

import random

import pytest
import torch

from qllm.config import SamplingParams
from qllm.layers.logprobs import packed_width, token_logprobs, unpack
from qllm.layers.penalties import LogitsAdjustments, apply_penalties
from qllm.layers.sampler import SamplingTensors, sample

BATCH, VOCAB, K = 256, 151_936, 5
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def synced(fn):
    """``fn`` timed to the end of its device work."""
    def call(*args):
        out = fn(*args)
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()
        return out
    return call


@pytest.fixture(scope="module")
def logits() -> torch.Tensor:  # bf16 on CUDA, as the model's logits there
    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
    return torch.randn(BATCH, VOCAB, generator=torch.Generator().manual_seed(0)).to(DEVICE,
                                                                                   dtype)


@pytest.fixture(scope="module")
def settings() -> SamplingTensors:  # W1 samples at temperature 0.6
    return SamplingTensors.build([SamplingParams(temperature=0.6)] * BATCH, [None] * BATCH,
                                 VOCAB, DEVICE)


def test_sample_step(benchmark, logits, settings):
    tokens = benchmark(synced(sample), logits, settings)
    assert tokens.shape == (BATCH,)


def test_sample_step_with_logprobs_5(benchmark, logits, settings):
    def step():
        tokens = sample(logits, settings)
        return token_logprobs(logits, tokens, K)

    packed = benchmark(synced(step))
    assert packed.shape == (BATCH, packed_width(K))


def test_host_unpack_logprobs_5(benchmark, logits):
    packed = token_logprobs(logits, logits.argmax(dim=-1), K).cpu()
    rows = benchmark(unpack, packed, K, [K] * BATCH)
    assert len(rows) == BATCH and all(len(row) == K for row in rows)


def test_penalties_build_and_apply(benchmark, logits):
    """Every row penalised, W1-like histories: prompts of 100-1024 tokens, 512 generated."""
    rng = random.Random(0)
    params = [SamplingParams(temperature=0.6, presence_penalty=0.5, frequency_penalty=0.5,
                             repetition_penalty=1.1)] * BATCH
    prompts = [[rng.randrange(10_000) for _ in range(rng.randint(100, 1024))]
               for _ in range(BATCH)]
    outputs = [[rng.randrange(VOCAB) for _ in range(512)] for _ in range(BATCH)]

    def step():
        adjust = LogitsAdjustments.build(params, prompts, outputs, None, [512] * BATCH, set(),
                                         VOCAB, DEVICE)
        return apply_penalties(logits, adjust)

    assert benchmark(synced(step)).shape == logits.shape
