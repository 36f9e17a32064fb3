"""Qwen3.5-35B-A3B geometry (first 4 layers: 3 Gated DeltaNet + 1 gated attention, 256-expert
MoE) on CUDA in bf16, with every installed kernel plugin: last-token logits against
transformers on the same random weights, and compiled (CUDA-graph) decode equal to eager."""

from __future__ import annotations

import pytest
import torch

from helpers import assert_cache_free, prefill_logits, random_prompts
from qllm import LLM, SamplingParams

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
qwen3_5_testing = pytest.importorskip("qllm_qwen3_5.testing")

VOCAB = 10000  # prompt token ids are drawn below this
ENGINE = dict(dtype="bfloat16", device="cuda", max_model_len=2048, max_num_seqs=16,
              kv_cache_memory_bytes=2 << 30)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """``(directory, transformers model on CUDA in bf16)``."""
    path = tmp_path_factory.mktemp("qwen3.5-35b-a3b-4-layers")
    model = qwen3_5_testing.build_real_geometry_model(num_hidden_layers=4)
    model.save_pretrained(path)
    return str(path), model


def test_bf16_last_token_logits_match_transformers(checkpoint):
    path, hf_model = checkpoint
    llm = LLM(path, enforce_eager=True, **ENGINE)
    for prompt in random_prompts([7, 100, 300, 1000], vocab_size=VOCAB):
        with torch.no_grad():
            expected = hf_model(torch.tensor([prompt], device="cuda")).logits[0, -1].float()
        got = prefill_logits(llm, prompt)[-1].float()
        cosine = torch.nn.functional.cosine_similarity(got, expected, dim=0).item()
        assert cosine >= 0.999, f"cosine {cosine:.5f} for a prompt of {len(prompt)} tokens"
        assert got.argmax().item() == expected.argmax().item()
    assert_cache_free(llm)


def test_compiled_decode_equals_eager(checkpoint):
    path, _ = checkpoint
    prompts = random_prompts([5 + 53 * i for i in range(16)], vocab_size=VOCAB)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    eager = LLM(path, enforce_eager=True, **ENGINE)
    expected = eager.generate(prompts, params, use_tqdm=False)
    del eager
    compiled = LLM(path, **ENGINE)
    assert compiled.engine.runner.graphs is not None
    got = compiled.generate(prompts, params, use_tqdm=False)
    assert [g["token_ids"] for g in got] == [e["token_ids"] for e in expected]
    assert_cache_free(compiled)
