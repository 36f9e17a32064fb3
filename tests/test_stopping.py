"""Stop conditions (EOS, stop token ids, stop strings, max_tokens) and chat."""

from __future__ import annotations

import pytest

from qllm import LLM, SamplingParams
from qllm.testing import assert_cache_free, random_prompts


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    return LLM(qwen3_dir, block_size=16)


@pytest.fixture(scope="module")
def text_llm(qwen3_tokenizer_model_dir):
    return LLM(qwen3_tokenizer_model_dir, block_size=16)


def greedy(max_tokens=24, **options):
    return SamplingParams(temperature=0, max_tokens=max_tokens, **options)


def test_max_tokens_finishes_with_length(llm):
    out = llm.generate(random_prompts([9]), greedy(7, ignore_eos=True), use_tqdm=False)[0]
    assert len(out["token_ids"]) == 7 and out["finish_reason"] == "length"


def test_stop_token_ids(llm):
    prompt = random_prompts([9])
    full = llm.generate(prompt, greedy(ignore_eos=True), use_tqdm=False)[0]["token_ids"]
    stop_at = full.index(full[5])  # first occurrence of the sixth token
    out = llm.generate(prompt, greedy(stop_token_ids=[full[5]], ignore_eos=True),
                       use_tqdm=False)[0]
    assert out["token_ids"] == full[:stop_at + 1] and out["finish_reason"] == "stop"


def test_eos_stops_unless_ignored(llm, monkeypatch):
    prompt = random_prompts([9])
    full = llm.generate(prompt, greedy(ignore_eos=True), use_tqdm=False)[0]["token_ids"]
    monkeypatch.setattr(llm.engine, "eos_token_ids", {full[4]})
    stopped = llm.generate(prompt, greedy(), use_tqdm=False)[0]
    assert stopped["token_ids"] == full[:full.index(full[4]) + 1]
    assert stopped["finish_reason"] == "stop"
    assert llm.generate(prompt, greedy(ignore_eos=True), use_tqdm=False)[0]["token_ids"] == full
    assert_cache_free(llm)


def test_stop_string_cuts_the_text(text_llm):
    full = text_llm.generate(["Once upon a time"], greedy(ignore_eos=True), use_tqdm=False)[0]
    text = full["text"]
    needle = text[len(text) // 2: len(text) // 2 + 3]
    assert needle.strip(), f"generated text too short to test: {text!r}"
    out = text_llm.generate(["Once upon a time"], greedy(stop=[needle], ignore_eos=True),
                            use_tqdm=False)[0]
    assert out["text"] == text[:text.index(needle)]
    assert out["finish_reason"] == "stop"
    assert_cache_free(text_llm)


def test_chat_applies_the_template(text_llm):
    conversation = [{"role": "user", "content": "Say hi"}]
    prompt = text_llm.tokenizer.apply_chat_template(conversation, tokenize=False,
                                                    add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")
    expected = text_llm.generate([prompt], greedy(8, ignore_eos=True), use_tqdm=False)
    assert text_llm.chat(conversation, greedy(8, ignore_eos=True), use_tqdm=False) == expected
