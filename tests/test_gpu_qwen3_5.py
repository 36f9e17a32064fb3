"""Hybrid models on CUDA. The Qwen3.5-35B-A3B geometry (first 4 layers: 3 Gated DeltaNet + 1
gated attention, 256-expert MoE) in bf16 with every installed kernel plugin: last-token logits
against transformers on the same random weights, and compiled (CUDA-graph) decode against
eager. Tiny hybrid models in fp32: compiled decode token for token."""

from __future__ import annotations

import copy

import pytest
import torch

from helpers import (assert_cache_free, assert_greedy_equal_up_to_ties, assert_same_tokens,
                     prefill_logits, random_prompts)
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


# Kernel pins for the logits test: the installed plugins, then the plain-torch kernels of the
# ops a prefill runs, so a miss says which kernel carries the error.
PINS = {
    "plugins": {},
    "torch-moe": {"fused_moe": "torch"},
    "torch-gdn": {"gdn_prefill": "torch", "causal_conv1d_prefill": "torch"},
    "torch-attention": {"paged_attention_prefill": "torch"},
}


@pytest.fixture(scope="module")
def reference_logits(checkpoint):
    """``[(prompt, transformers bf16 logits, transformers fp32 logits)]`` of the last token."""
    _, hf_model = checkpoint
    hf_fp32 = copy.deepcopy(hf_model).float()
    out = []
    for prompt in random_prompts([7, 100, 300, 1000], vocab_size=VOCAB):
        with torch.no_grad():
            ids = torch.tensor([prompt], device="cuda")
            out.append((prompt, hf_model(ids).logits[0, -1], hf_fp32(ids).logits[0, -1]))
    return out


@pytest.mark.parametrize("pins", PINS.values(), ids=PINS.keys())
def test_bf16_last_token_logits_match_transformers(checkpoint, reference_logits, pins):
    """qllm in bf16 against transformers in fp32 on the same weights: cosine >= 0.999 and the
    same argmax. transformers in bf16 is reported beside it but is not the oracle: at this
    geometry its own bf16 error is of the order of the tolerance (2026-11-29, router
    perturbed: transformers-bf16 vs fp32 cosine 0.9938-0.9992)."""
    path, _ = checkpoint
    llm = LLM(path, enforce_eager=True, kernels=pins, **ENGINE)
    report, failures = [], []
    for prompt, hf_bf16, exact in reference_logits:
        got = prefill_logits(llm, prompt)[-1]
        cosine = _cosine(got, exact)
        report.append(f"{len(prompt)} tokens: qllm-bf16/hf-fp32 {cosine:.5f}, "
                      f"hf-bf16/hf-fp32 {_cosine(hf_bf16, exact):.5f}, "
                      f"qllm-bf16/hf-bf16 {_cosine(got, hf_bf16):.5f}")
        if cosine < 0.999 or got.argmax() != exact.argmax():
            failures.append(report[-1])
    print("\n".join(report))
    assert not failures, "; ".join(failures)
    assert_cache_free(llm)


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=0).item()


def test_bf16_compiled_decode_equals_eager(checkpoint):
    """CUDA-graph decode with the kernel plugins equals eager decode, 16 prompts x 32 greedy
    tokens, up to bf16 near-ties."""
    path, _ = checkpoint
    prompts = random_prompts([5 + 53 * i for i in range(16)], vocab_size=VOCAB)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    eager = LLM(path, enforce_eager=True, **ENGINE)
    expected = eager.generate(prompts, params, use_tqdm=False)
    compiled = LLM(path, **ENGINE)
    assert compiled.engine.runner.graphs is not None
    got = compiled.generate(prompts, params, use_tqdm=False)
    assert_greedy_equal_up_to_ties(eager, prompts, got, expected)
    assert_cache_free(compiled)


@pytest.mark.parametrize("kind", ["qwen3_5_moe", "qwen3_next"])
def test_fp32_compiled_decode_equals_eager(kind, tmp_path):
    """The CUDA-graph machinery (slots as graph inputs, padding rows, buckets) on tiny hybrid
    models in fp32: token for token."""
    qwen3_5_testing.save_checkpoint(kind, str(tmp_path), max_position_embeddings=2048)
    prompts = random_prompts([5 + 29 * i for i in range(16)], vocab_size=512)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    engine = dict(dtype="float32", device="cuda", max_num_seqs=16, max_model_len=2048,
                  kv_cache_memory_bytes=1 << 30)
    expected = LLM(str(tmp_path), enforce_eager=True, **engine).generate(prompts, params,
                                                                        use_tqdm=False)
    compiled = LLM(str(tmp_path), **engine)
    assert compiled.engine.runner.graphs is not None
    assert_same_tokens(compiled.generate(prompts, params, use_tqdm=False), expected)
    assert_cache_free(compiled)
