"""``qllm.layers.sampler``: greedy and sampled tokens from logits of any float dtype."""

from __future__ import annotations

import torch

from qllm import SamplingParams
from qllm.layers.sampler import SamplingTensors, sample

CPU = torch.device("cpu")
VOCAB = 50


def settings(params: list[SamplingParams], seeds: list[int | None] | None = None):
    generators = [None if seed is None else torch.Generator().manual_seed(seed)
                  for seed in (seeds or [None] * len(params))]
    return SamplingTensors.build(params, generators, VOCAB, CPU)


def test_greedy_argmax_of_half_logits_is_the_fp32_one():
    logits = torch.randn(6, VOCAB).to(torch.bfloat16)
    logits[0, 7] = logits[0, 9] = logits[0].max() + 1  # a tie: the first index wins
    greedy = settings([SamplingParams(temperature=0)] * 6)
    assert greedy.all_greedy and greedy.temperature is None  # nothing copied to the device
    tokens = sample(logits, greedy)
    assert torch.equal(tokens, logits.float().argmax(dim=-1)) and tokens[0] == 7


def test_mixed_batch_samples_in_fp32_and_keeps_greedy_rows():
    logits = torch.randn(4, VOCAB).to(torch.bfloat16)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_k=1),
              SamplingParams(temperature=0.7, top_p=1e-6), SamplingParams(temperature=1.0)]
    tokens = sample(logits, settings(params))
    best = logits.float().argmax(dim=-1)
    assert tokens.dtype == torch.int64 and torch.equal(tokens[:3], best[:3])
    assert 0 <= tokens[3] < VOCAB


def test_seeded_rows_do_not_depend_on_the_rest_of_the_batch():
    logits = torch.randn(3, VOCAB)
    seeded = SamplingParams(temperature=1.0, seed=5)
    alone = sample(logits[:1], settings([seeded], [5]))
    batched = sample(logits, settings([seeded, SamplingParams(temperature=1.0),
                                       SamplingParams(temperature=0)], [5, None, None]))
    assert alone[0] == batched[0]


def test_sampling_follows_the_softmax():
    """Two tokens with probabilities 0.8 / 0.2 (logits log 4 apart), 20,000 seeded draws."""
    logits = torch.full((20_000, VOCAB), -float("inf"))
    logits[:, 0], logits[:, 1] = torch.tensor(4.0).log(), 0.0
    torch.manual_seed(0)
    tokens = sample(logits, settings([SamplingParams(temperature=1.0)] * 20_000))
    assert set(tokens.unique().tolist()) <= {0, 1}
    assert abs((tokens == 0).float().mean().item() - 0.8) < 0.02


def test_unseeded_draws_go_to_the_op_and_seeded_batches_do_not():
    """``sample`` hands unseeded batches to its ``sample_tokens`` op (top-k / top-p filtered
    and scaled first, temperature 1 then), with a seed from torch's CPU generator; a batch
    with a seeded row is drawn in plain torch."""
    calls = []

    def op(logits, temperature, seed):
        calls.append((logits.clone(), temperature.clone(), seed))
        return torch.zeros(logits.shape[0], dtype=torch.int64)

    logits = torch.randn(3, VOCAB)
    plain = [SamplingParams(temperature=0.5), SamplingParams(temperature=0),
             SamplingParams(temperature=2.0)]
    torch.manual_seed(3)
    sample(logits, settings(plain), op)
    torch.manual_seed(3)
    sample(logits, settings(plain), op)
    (first, temperature, seed), (_, _, seed_again) = calls
    assert torch.equal(first, logits) and temperature.tolist() == [0.5, 0.0, 2.0]
    assert seed == seed_again  # torch.manual_seed repeats the draw
    calls.clear()
    tokens = sample(logits, settings([SamplingParams(temperature=0.5, top_k=3),
                                      SamplingParams(temperature=0)] + plain[2:]), op)
    (filtered, temperature, _), = calls
    assert temperature.tolist() == [1.0, 0.0, 1.0] and tokens[1] == logits[1].argmax()
    assert torch.isinf(filtered[0]).sum() == VOCAB - 3
    calls.clear()
    sample(logits, settings(plain, [None, None, 7]), op)
    assert not calls
