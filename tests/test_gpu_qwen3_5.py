"""Qwen3.5-35B-A3B geometry (first 4 layers: 3 Gated DeltaNet + 1 gated attention, 256-expert
MoE) on CUDA in bf16, with every installed kernel plugin: last-token logits against
transformers on the same random weights, and compiled (CUDA-graph) decode equal to eager."""

from __future__ import annotations

import copy

import pytest
import torch

from helpers import assert_cache_free, assert_same_tokens, prefill_logits, random_prompts
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
    """qllm in bf16 against transformers in bf16 (the issue's criterion); both are also
    compared with transformers in fp32, so a miss says which side carries the error."""
    path, hf_model = checkpoint
    llm = LLM(path, enforce_eager=True, **ENGINE)
    hf_fp32 = copy.deepcopy(hf_model).float()
    report, failures = [], []
    for prompt in random_prompts([7, 100, 300, 1000], vocab_size=VOCAB):
        with torch.no_grad():
            ids = torch.tensor([prompt], device="cuda")
            expected = hf_model(ids).logits[0, -1].float()
            exact = hf_fp32(ids).logits[0, -1]
        got = prefill_logits(llm, prompt)[-1].float()
        cosine = _cosine(got, expected)
        report.append(f"{len(prompt)} tokens: qllm/hf {cosine:.5f}, qllm/hf-fp32 "
                      f"{_cosine(got, exact):.5f}, hf/hf-fp32 {_cosine(expected, exact):.5f}")
        if cosine < 0.999 or got.argmax() != expected.argmax():
            failures.append(report[-1])
    print("\n".join(report))
    assert not failures, "; ".join(failures)
    assert_cache_free(llm)


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=0).item()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_compiled_decode_equals_eager(checkpoint, dtype):
    """Greedy tokens of CUDA-graph decode equal eager decode, 16 prompts x 32 tokens (fp32:
    the plain-torch kernels; bf16: the installed kernel plugins)."""
    path, _ = checkpoint
    prompts = random_prompts([5 + 53 * i for i in range(16)], vocab_size=VOCAB)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    engine = {**ENGINE, "dtype": dtype}
    expected = LLM(path, enforce_eager=True, **engine).generate(prompts, params,
                                                                 use_tqdm=False)
    compiled = LLM(path, **engine)
    assert compiled.engine.runner.graphs is not None
    got = compiled.generate(prompts, params, use_tqdm=False)
    assert_same_tokens(got, expected)
    assert_cache_free(compiled)
