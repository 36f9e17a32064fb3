"""``SamplingParams.n``: several completions per prompt, each seeded ``seed + i``."""

from __future__ import annotations

import pytest

from qllm import LLM, SamplingParams
from qllm.testing import assert_cache_free, random_prompts


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    return LLM(qwen3_dir, block_size=16, max_model_len=128)


def sampled(**options) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, **options)


def test_n_choices_are_the_seeded_requests_one_by_one(llm):
    prompts = random_prompts([10, 6])
    results = llm.generate(prompts, sampled(n=3, seed=11, logprobs=1), use_tqdm=False)
    assert len(results) == 2
    for prompt, result in zip(prompts, results):
        assert result["prompt_token_ids"] == prompt and len(result["outputs"]) == 3
        for key in ("text", "token_ids", "finish_reason", "logprobs", "cumulative_logprob"):
            assert result[key] == result["outputs"][0][key]  # the first choice's, on top
        for i, choice in enumerate(result["outputs"]):
            alone = llm.generate([prompt], sampled(seed=11 + i, logprobs=1), use_tqdm=False)[0]
            assert choice["token_ids"] == alone["token_ids"]
            for got, want in zip(choice["logprobs"], alone["logprobs"]):  # batch-size noise
                assert list(got) == list(want)
                assert [lp.logprob for lp in got.values()] == pytest.approx(
                    [lp.logprob for lp in want.values()], abs=1e-5)
        assert len({tuple(c["token_ids"]) for c in result["outputs"]}) == 3
    assert_cache_free(llm)


def test_each_prompt_is_tokenized_and_validated_once_for_all_its_choices(llm, monkeypatch):
    engine = llm.engine
    calls = {"tokenize": 0, "validate": 0}
    for name in calls:
        def counted(*args, _name=name, _method=getattr(engine, name)):
            calls[_name] += 1
            return _method(*args)
        monkeypatch.setattr(engine, name, counted)
    results = llm.generate(random_prompts([9, 4]), sampled(n=3, seed=2), use_tqdm=False)
    assert [len(r["outputs"]) for r in results] == [3, 3]
    assert calls == {"tokenize": 2, "validate": 2}


def test_unseeded_choices_are_independent(llm):
    result = llm.generate(random_prompts([10]), sampled(n=6), use_tqdm=False)[0]
    assert len({tuple(c["token_ids"]) for c in result["outputs"]}) == 6


def test_one_choice_has_the_same_shape(llm):
    result = llm.generate(random_prompts([4]), sampled(seed=1), use_tqdm=False)[0]
    assert len(result["outputs"]) == 1
    assert {k: result[k] for k in result["outputs"][0]} == result["outputs"][0]


def test_prompt_logprobs_come_once_per_prompt(llm):
    result = llm.generate(random_prompts([12]), sampled(n=2, seed=3, prompt_logprobs=2),
                          use_tqdm=False)[0]
    assert len(result["prompt_logprobs"]) == 12 and result["prompt_logprobs"][0] is None


@pytest.mark.parametrize("options, error, message", [
    pytest.param({"n": 0}, ValueError, "n must be", id="n-0"),
    pytest.param({"n": 2.0}, TypeError, "n must be", id="n-a-float"),
    pytest.param({"logprobs": -1}, ValueError, "logprobs must be", id="negative-logprobs"),
    pytest.param({"logprobs": True}, TypeError, "logprobs must be", id="logprobs-a-bool"),
    pytest.param({"prompt_logprobs": -2}, ValueError, "prompt_logprobs", id="prompt_logprobs"),
    pytest.param({"presence_penalty": 2.5}, ValueError, "presence_penalty must be in",
                 id="presence-above-2"),
    pytest.param({"frequency_penalty": float("nan")}, ValueError, "frequency_penalty must be "
                 "a finite", id="nan-frequency"),
    pytest.param({"repetition_penalty": 0}, ValueError, "repetition_penalty must be > 0",
                 id="repetition-0"),
    pytest.param({"min_tokens": 20, "max_tokens": 10}, ValueError, "min_tokens must be in",
                 id="min_tokens-above-max_tokens"),
    pytest.param({"min_tokens": -1}, ValueError, "min_tokens", id="negative-min_tokens"),
])
def test_bad_values_name_the_field(options, error, message):
    with pytest.raises(error, match=message):
        SamplingParams(**options)
