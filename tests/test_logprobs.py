"""Log-probs of generated and prompt tokens (``SamplingParams.logprobs`` /
``prompt_logprobs``) against ``log_softmax`` of transformers' logits, in fp32 on the CPU."""

from __future__ import annotations

import pytest
import torch

from qllm import LLM, Logprob, SamplingParams
from qllm.layers.logprobs import token_logprobs, unpack
from qllm.testing import assert_cache_free, random_prompts, with_decode_graphs

TOLERANCE = 1e-4


def reference_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    """transformers' ``log_softmax`` of the logits at every position ``[T, V]`` (fp32)."""
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def check_entry(entry: dict, token: int, reference: torch.Tensor, k: int) -> None:
    """``entry`` ({token: Logprob}) scores ``token`` first, then holds the ``k`` most likely
    tokens of ``reference [V]``, every log-prob within TOLERANCE and ranks consistent."""
    assert next(iter(entry)) == token
    assert len(entry) in (k, k + 1) and token in entry
    chosen = entry[token]
    assert abs(chosen.logprob - reference[token].item()) < TOLERANCE
    # rank 1 + the tokens more likely, up to numerical ties
    above = (reference > reference[token] + TOLERANCE).sum().item()
    at_least = (reference > reference[token] - TOLERANCE).sum().item()
    assert above + 1 <= chosen.rank <= at_least + 1
    kth = reference.topk(k).values[-1].item() if k else float("inf")
    for top_id, logprob in entry.items():
        assert abs(logprob.logprob - reference[top_id].item()) < TOLERANCE
        if top_id != token:
            assert reference[top_id].item() >= kth - TOLERANCE and 1 <= logprob.rank <= k


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_logprobs_match_transformers(qwen3_checkpoint, async_scheduling):
    """Sampled, penalised and greedy rows in one batch, prompts chunked over several prefill
    steps: every token's log-prob is of the raw model distribution."""
    path, model = qwen3_checkpoint
    llm = LLM(path, block_size=16, max_model_len=128, max_num_batched_tokens=32,
              async_scheduling=async_scheduling)
    prompts = random_prompts([45, 7, 20])
    params = [SamplingParams(temperature=0.8, seed=1, max_tokens=8, ignore_eos=True,
                             logprobs=5, prompt_logprobs=3),
              SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0,
                             prompt_logprobs=0),
              SamplingParams(temperature=1.2, top_k=20, top_p=0.9, seed=2, max_tokens=8,
                             ignore_eos=True, logprobs=2, presence_penalty=1.5,
                             repetition_penalty=1.4)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, p, out in zip(prompts, params, outputs):
        tokens = out["token_ids"]
        reference = reference_logprobs(model, prompt + tokens)
        assert len(out["logprobs"]) == len(tokens) == p.max_tokens
        for i, (token, entry) in enumerate(zip(tokens, out["logprobs"])):
            check_entry(entry, token, reference[len(prompt) - 1 + i], p.logprobs)
        total = sum(entry[token].logprob for token, entry in zip(tokens, out["logprobs"]))
        assert out["cumulative_logprob"] == pytest.approx(total, abs=1e-6)
        if p.prompt_logprobs is None:
            assert out["prompt_logprobs"] is None
            continue
        assert len(out["prompt_logprobs"]) == len(prompt) and out["prompt_logprobs"][0] is None
        for j in range(1, len(prompt)):
            check_entry(out["prompt_logprobs"][j], prompt[j], reference[j - 1],
                        p.prompt_logprobs)
    greedy = outputs[1]
    assert all(entry[t].rank == 1 for t, entry in zip(greedy["token_ids"], greedy["logprobs"]))
    assert all(set(entry) == {t} for t, entry in zip(greedy["token_ids"], greedy["logprobs"]))
    assert_cache_free(llm)


def test_no_logprobs_unless_asked(qwen3_dir):
    llm = LLM(qwen3_dir, block_size=16, max_model_len=64)
    out = llm.generate(random_prompts([5]), SamplingParams(max_tokens=3), use_tqdm=False)[0]
    assert out["logprobs"] is None and out["prompt_logprobs"] is None
    assert out["cumulative_logprob"] is None


def test_prompt_logprobs_skip_the_prefix_cache(qwen3_checkpoint):
    """A cached prefix has no logits to score its tokens with: a request for prompt
    log-probs computes its whole prompt (later requests still hit the cache)."""
    path, model = qwen3_checkpoint
    llm = LLM(path, block_size=16, max_model_len=128)
    prompt = random_prompts([40], seed=3)[0]
    greedy = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    llm.generate([prompt], greedy, use_tqdm=False)
    scored = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2,
                                                   ignore_eos=True, prompt_logprobs=1),
                          use_tqdm=False)[0]
    assert scored["num_cached_tokens"] == 0
    reference = reference_logprobs(model, prompt)
    for j in range(1, len(prompt)):
        check_entry(scored["prompt_logprobs"][j], prompt[j], reference[j - 1], 1)
    assert llm.generate([prompt], greedy, use_tqdm=False)[0]["num_cached_tokens"] == 32


def test_prompt_logprobs_survive_preemption(qwen3_checkpoint):
    """Preempted and recomputed sequences neither lose nor repeat prompt log-probs."""
    path, model = qwen3_checkpoint
    llm = LLM(path, block_size=16, max_model_len=128, num_kv_blocks=8,
              max_num_batched_tokens=32)
    prompts = random_prompts([30, 30, 30], seed=4)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, prompt_logprobs=1,
                            logprobs=1)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outputs):
        reference = reference_logprobs(model, prompt + out["token_ids"])
        assert len(out["prompt_logprobs"]) == len(prompt)
        for j in range(1, len(prompt)):
            check_entry(out["prompt_logprobs"][j], prompt[j], reference[j - 1], 1)
        for i, (token, entry) in enumerate(zip(out["token_ids"], out["logprobs"])):
            check_entry(entry, token, reference[len(prompt) - 1 + i], 1)
    assert_cache_free(llm)


def test_packed_logprobs_round_trip():
    """The packed rows bring back fp32 log-probs exactly, ranks and top ids too."""
    logits = torch.randn(3, 40)
    tokens = torch.tensor([5, 0, 39])
    rows = unpack(token_logprobs(logits, tokens, 4), 4, [4, None, 2])
    reference = torch.log_softmax(logits, dim=-1)
    assert rows[1] is None
    for row, token, want in ((0, 5, 4), (2, 39, 2)):
        entry = rows[row]
        assert next(iter(entry)) == token
        assert entry[token] == Logprob(reference[row, token].item(),
                                       int((reference[row] > reference[row, token]).sum()) + 1)
        top = reference[row].topk(want)
        for rank, (value, index) in enumerate(zip(top.values, top.indices), start=1):
            assert entry[index.item()].logprob == value.item()
            if index.item() != token:
                assert entry[index.item()].rank == rank


def test_logprobs_through_decode_graphs_equal_eager(qwen3_dir):
    """Decode steps on the CUDA-graph path (padded buckets, replayed on the CPU) score their
    tokens as eager steps do."""
    prompts = random_prompts([9, 14, 5])
    params = SamplingParams(temperature=0.7, seed=4, max_tokens=6, ignore_eos=True,
                            logprobs=3, presence_penalty=0.5)
    eager = LLM(qwen3_dir, block_size=16, max_model_len=64).generate(prompts, params,
                                                                      use_tqdm=False)
    graphed = with_decode_graphs(LLM(qwen3_dir, block_size=16, max_model_len=64), [4])
    assert graphed.engine.runner.graphs.bucket(3) == 4
    for got, want in zip(graphed.generate(prompts, params, use_tqdm=False), eager):
        assert got["token_ids"] == want["token_ids"]
        for a, b in zip(got["logprobs"], want["logprobs"]):
            assert list(a) == list(b) and [lp.rank for lp in a.values()] == \
                [lp.rank for lp in b.values()]
            assert [lp.logprob for lp in a.values()] == pytest.approx(
                [lp.logprob for lp in b.values()], abs=1e-5)
