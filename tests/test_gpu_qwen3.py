"""Qwen3 on CUDA in bf16: parity with transformers, and compiled decode equal to eager."""

from __future__ import annotations

import pytest
import torch

from helpers import prefill_logits, random_prompts, save_tiny_qwen3
from qllm import LLM, SamplingParams

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

VOCAB = 2048


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-gpu")
    model = save_tiny_qwen3(path, vocab_size=VOCAB, hidden_size=256, intermediate_size=768,
                            num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                            head_dim=64, max_position_embeddings=4096)
    return str(path), model.to("cuda", torch.bfloat16)


def test_bf16_last_token_logits_match_transformers(checkpoint):
    path, hf_model = checkpoint
    llm = LLM(path, dtype="bfloat16", device="cuda", enforce_eager=True, block_size=16,
              kv_cache_memory_bytes=1 << 30)
    for prompt in random_prompts([7, 100, 300, 1000], vocab_size=VOCAB):
        with torch.no_grad():
            expected = hf_model(torch.tensor([prompt], device="cuda")).logits[0, -1].float()
        got = prefill_logits(llm, prompt)[-1]
        cosine = torch.nn.functional.cosine_similarity(got, expected, dim=0).item()
        assert cosine >= 0.999, f"cosine {cosine:.5f} for a prompt of {len(prompt)} tokens"
        assert got.argmax().item() == expected.argmax().item()


def test_compiled_decode_equals_eager(checkpoint):
    path, _ = checkpoint
    prompts = random_prompts([5 + 37 * i for i in range(16)], vocab_size=VOCAB)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    eager = LLM(path, dtype="bfloat16", device="cuda", enforce_eager=True, max_num_seqs=16,
                kv_cache_memory_bytes=1 << 30)
    compiled = LLM(path, dtype="bfloat16", device="cuda", max_num_seqs=16,
                   kv_cache_memory_bytes=1 << 30)
    assert compiled.engine.runner.graphs is not None
    expected = eager.generate(prompts, params, use_tqdm=False)
    got = compiled.generate(prompts, params, use_tqdm=False)
    assert [g["token_ids"] for g in got] == [e["token_ids"] for e in expected]
