"""qllm's hybrid Qwen3.5 / Qwen3.5-MoE / Qwen3-Next against transformers on tiny random
checkpoints (fp32, CPU): prefill logits, greedy generation, and scheduling (slot reuse,
waves, chunked prefill, preemption) never changing a sequence's tokens."""

from __future__ import annotations

import pytest
import torch

from qllm import LLM, SamplingParams
from qllm.testing import assert_cache_free, prefill_logits, random_prompts

qwen3_5_testing = pytest.importorskip("qllm_qwen3_5.testing")

MAX_TOKENS = 64
LENGTHS = [3, 17, 40, 64, 65, 100, 129, 200]  # several prompts longer than one GDN chunk
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
ENGINE = dict(block_size=16, max_model_len=320, num_kv_blocks=128)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", params=qwen3_5_testing.KINDS)
def reference(request, tmp_path_factory):
    """``(checkpoint dir, transformers model, prompts, transformers' greedy tokens)``."""
    path = str(tmp_path_factory.mktemp(request.param))
    model = qwen3_5_testing.save_checkpoint(request.param, path)
    prompts = random_prompts(LENGTHS)
    return path, model, prompts, qwen3_5_testing.hf_greedy(model, prompts, MAX_TOKENS)


def test_prefill_logits_match_transformers(reference):
    path, model, prompts, _ = reference
    llm = LLM(path, **ENGINE)
    for prompt in [p for p in prompts if len(p) > 64]:
        expected = qwen3_5_testing.hf_logits(model, prompt)
        torch.testing.assert_close(prefill_logits(llm, prompt), expected, atol=1e-4, rtol=0)
    assert_cache_free(llm)


def test_exact_reference_logits_match_in_process_transformers(tmp_path):
    """The GPU tests' fp32 oracle (transformers in a child process, fla blocked) gives the
    same last-token logits as the in-process transformers model."""
    model = qwen3_5_testing.save_checkpoint("qwen3_5_moe", str(tmp_path))
    prompts = random_prompts([5, 100])
    exact = qwen3_5_testing.exact_reference_logits(str(tmp_path), prompts, device="cpu")
    for prompt, logits in zip(prompts, exact):
        torch.testing.assert_close(logits, qwen3_5_testing.hf_logits(model, prompt)[-1],
                                   atol=1e-5, rtol=0)


@pytest.mark.parametrize("options", [
    pytest.param({}, id="all-together"),
    pytest.param({"max_num_batched_tokens": 48}, id="chunked-prefill"),
])
def test_greedy_matches_transformers(reference, options):
    path, _, prompts, expected = reference
    llm = LLM(path, **{**ENGINE, **options})
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, out, ref in zip(prompts, outputs, expected):
        assert out["token_ids"] == ref, f"prompt of {len(prompt)} tokens diverged"
    assert_cache_free(llm)


# ----------------------------------------------------------------------------- scheduling

SCHEDULING_KINDS = ["qwen3_5_moe", "qwen3_next"]
MAX_TOKENS_EACH = [5, 64, 20, 33, 1, 50, 12, 40, 64, 9]  # finish at different times


@pytest.fixture(scope="module", params=SCHEDULING_KINDS)
def alone(request, tmp_path_factory):
    """``(checkpoint dir, prompts, params, each prompt's tokens when run alone)``."""
    path = str(tmp_path_factory.mktemp(f"{request.param}-sched"))
    model = qwen3_5_testing.save_checkpoint(request.param, path, seed=1)
    prompts = random_prompts(LENGTHS + [90, 31], seed=3)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
              for n in MAX_TOKENS_EACH]
    llm = LLM(path, **ENGINE)
    outputs = [llm.generate([p], sp, use_tqdm=False)[0]["token_ids"]
               for p, sp in zip(prompts, params)]
    full = qwen3_5_testing.hf_greedy(model, prompts, MAX_TOKENS)
    for out, ref, n in zip(outputs, full, MAX_TOKENS_EACH):
        assert out == ref[:n], "a prompt run alone differs from transformers"
    assert_cache_free(llm)
    return path, prompts, params, outputs


@pytest.mark.parametrize("max_num_seqs", [2, 3], ids=["2-slots", "3-slots"])
def test_slot_reuse_submitted_together(alone, max_num_seqs):
    path, prompts, params, expected = alone
    llm = LLM(path, **ENGINE, max_num_seqs=max_num_seqs)
    assert llm.engine.cache.pools["recurrent_slot"].num_units == max_num_seqs
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [out["token_ids"] for out in outputs] == expected
    assert_cache_free(llm)


def test_slot_reuse_submitted_in_waves(alone):
    path, prompts, params, expected = alone
    llm = LLM(path, **ENGINE, max_num_seqs=3, max_num_batched_tokens=64)
    engine = llm.engine
    seqs = []
    for start in range(0, len(prompts), 3):  # a new wave every few steps, mid-decode
        seqs += [engine.add_request(p, sp) for p, sp in
                 zip(prompts[start:start + 3], params[start:start + 3])]
        for _ in range(4):
            engine.step()
    while engine.has_unfinished():
        engine.step()
    assert [seq.output_token_ids for seq in seqs] == expected
    assert_cache_free(llm)


def test_preemption_mid_decode(alone):
    path, prompts, params, expected = alone
    llm = LLM(path, **{**ENGINE, "num_kv_blocks": 24}, max_num_seqs=4)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0, "the KV budget should force preemption"
    assert [out["token_ids"] for out in outputs] == expected
    assert_cache_free(llm)


def test_compiled_decode_equals_eager(alone):
    """Regional torch.compile of the hybrid layers (GDN, gated attention, MoE) with slots
    reused by more prompts than slots: the same tokens as the eager engine."""
    path, prompts, params, expected = alone
    llm = LLM(path, **ENGINE, max_num_seqs=3, compile_on_cpu=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [out["token_ids"] for out in outputs] == expected
    assert_cache_free(llm)
