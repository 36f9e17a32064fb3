"""qllm's Qwen3 against transformers on tiny random checkpoints (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch

from qllm import LLM, SamplingParams
from qllm.engine.diagnostics import teacher_forced_logits
from qllm.testing import assert_cache_free, hf_greedy, prefill_logits, random_prompts

MAX_TOKENS = 64
LENGTHS = [3, 17, 40, 64, 65, 100, 129, 200, 7, 33]
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def references(qwen3_checkpoint):
    path, hf_model = qwen3_checkpoint
    prompts = random_prompts(LENGTHS)
    return path, hf_model, prompts, [hf_greedy(hf_model, p, MAX_TOKENS) for p in prompts]


def test_prefill_logits_match_transformers(references):
    path, hf_model, prompts, _ = references
    llm = LLM(path, block_size=16)
    for prompt in prompts[:6]:
        with torch.no_grad():
            expected = hf_model(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(prefill_logits(llm, prompt), expected, atol=1e-4, rtol=0)
    assert_cache_free(llm)


def test_teacher_forced_logits_equal_prefill_logits(references):
    """``teacher_forced_logits`` (used on the GPU to compare compiled with eager decode, and
    fp32 with bf16 state): each step's logits equal the prefill logits of the same prefix."""
    path, _, prompts, expected = references
    llm = LLM(path, block_size=16)
    forced = [tokens[:3] for tokens in expected[:4]]
    steps = teacher_forced_logits(llm, prompts[:4], forced)  # [3, 4, V]
    for b, (prompt, tokens) in enumerate(zip(prompts, forced)):
        for step in range(3):
            reference = prefill_logits(llm, prompt + tokens[:step])[-1]
            torch.testing.assert_close(steps[step, b], reference, atol=1e-4, rtol=0)
    assert_cache_free(llm)


@pytest.mark.parametrize("options", [
    pytest.param({}, id="all-together"),
    pytest.param({"num_kv_blocks": 40}, id="preemption"),
    pytest.param({"max_num_batched_tokens": 48}, id="chunked-prefill"),
    pytest.param({"max_num_seqs": 3}, id="few-seqs"),
])
def test_greedy_matches_transformers(references, options):
    path, _, prompts, expected = references
    llm = LLM(path, block_size=16, max_model_len=320, **options)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, out, ref in zip(prompts, outputs, expected):
        assert out["token_ids"] == ref, f"prompt of {len(prompt)} tokens diverged"
        assert out["finish_reason"] == "length"
    if "num_kv_blocks" in options:
        assert llm.engine.scheduler.num_preemptions > 0, "the budget should force preemption"
    assert_cache_free(llm)


def test_one_at_a_time_equals_together(references):
    path, _, prompts, expected = references
    llm = LLM(path, block_size=16)
    for prompt, ref in zip(prompts, expected):
        assert llm.generate([prompt], GREEDY, use_tqdm=False)[0]["token_ids"] == ref
        assert_cache_free(llm)


def test_shared_prefixes_hit_the_prefix_cache(references):
    path, hf_model, _, _ = references
    shared = random_prompts([70], seed=1)[0]
    prompts = [shared + tail for tail in random_prompts([5, 9, 20, 1, 33, 12, 16, 40], seed=2)]
    llm = LLM(path, block_size=16)
    first = llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    rest = llm.generate(prompts[1:], GREEDY, use_tqdm=False)
    assert first[0]["num_cached_tokens"] == 0
    assert all(out["num_cached_tokens"] >= 64 for out in rest), "shared blocks were recomputed"
    for prompt, out in zip(prompts, first + rest):
        assert out["token_ids"] == hf_greedy(hf_model, prompt, MAX_TOKENS)
    assert_cache_free(llm)


def test_sampling_is_reproducible_with_a_seed(qwen3_dir):
    llm = LLM(qwen3_dir, block_size=16)
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=123, max_tokens=24,
                            ignore_eos=True)
    prompts = random_prompts([10, 20, 30])
    alone = llm.generate(prompts[:1], params, use_tqdm=False)[0]["token_ids"]
    batched = llm.generate(prompts, [params, SamplingParams(temperature=1.0, max_tokens=5),
                                     params], use_tqdm=False)
    assert batched[0]["token_ids"] == alone
    assert len(set(alone)) > 1
    assert_cache_free(llm)


@pytest.mark.parametrize("max_autotune_gemm", [False, True], ids=["default", "gemm-autotune"])
def test_compiled_decode_equals_eager_on_cpu(qwen3_dir, max_autotune_gemm):
    """The compiled decode path (regional torch.compile; CUDA graphs only on GPU) gives the
    eager tokens, with a prefill step in between that must bypass the compiled layers; also
    with Inductor's GEMM autotuning in the decode layers."""
    prompts = random_prompts([5, 20, 33, 47])
    eager = LLM(qwen3_dir, block_size=16).generate(prompts, GREEDY, use_tqdm=False)
    compiled = LLM(qwen3_dir, block_size=16, compile_on_cpu=True, max_num_batched_tokens=64,
                   max_autotune_gemm=max_autotune_gemm)
    got = compiled.generate(prompts, GREEDY, use_tqdm=False)
    assert [g["token_ids"] for g in got] == [e["token_ids"] for e in eager]
    assert_cache_free(compiled)
