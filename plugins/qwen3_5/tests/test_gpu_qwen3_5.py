"""Hybrid models on CUDA. The Qwen3.5-35B-A3B geometry (first 4 layers: 3 Gated DeltaNet + 1
gated attention, 256-expert MoE whose experts share a common component, see
``build_real_geometry_model``) in bf16 with every installed kernel plugin: last-token logits
against transformers on the same random weights, and compiled (CUDA-graph) decode and
prefill against eager. Tiny hybrid models in fp32: compiled decode token for token, and
prefill without graphs where a kernel syncs with the host; in bf16, compiling the Triton
kernels ahead (``QLLM_COMPILE_AHEAD=1``) changes no token."""

from __future__ import annotations

import math

import pytest
import torch

from qllm import LLM, SamplingParams
from qllm.engine.diagnostics import teacher_forced_logits
from qllm.testing import (assert_cache_free, assert_same_tokens, last_token_logits,
                          prefill_logits, random_prompts)

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


# Kernel pins for the logits test: the installed plugins, then one op at a time on another
# kernel, so a miss says which kernel carries the error.
PINS = {
    "plugins": {},
    "triton-gdn-prefill": {"gdn_prefill": "triton"},
    "torch-gdn": {"gdn_prefill": "torch", "causal_conv1d_prefill": "torch"},
    "torch-moe": {"fused_moe": "torch"},
    "torch-attention": {"paged_attention_prefill": "torch"},
}
PROMPT_LENGTHS = [7, 100, 300, 1000]
# Each bf16 engine is held within cosine 0.999 of the exact logits: a relative error of
# sqrt(2 (1 - 0.999)) = 0.045, about 0.045 std per logit, and sqrt(2) times that on the
# difference of two logits. A bf16 result may pick another token only where the exact top two
# are within three times that (0.19 std), a numerical tie; a wrong state or cache slot moves
# the logits far more and fails the cosine first.
TIE_STD = 3 * math.sqrt(2) * math.sqrt(2 * (1 - 0.999))
# Each bf16 engine is held within cosine 0.999 of the exact logits, so two of them (compiled
# and eager) can be apart by up to twice that angle: cos(2 acos 0.999) = 0.996.
TWO_ROUNDINGS_COSINE = math.cos(2 * math.acos(0.999))


@pytest.fixture(scope="module")
def reference_logits(checkpoint):
    """``[(prompt, transformers bf16 logits, exact fp32 logits)]`` of the last token. The
    exact reference is transformers in fp32 on its plain-torch GDN path
    (``exact_reference_logits``); transformers in bf16 runs as installed (fla's kernels)."""
    path, hf_model = checkpoint
    prompts = random_prompts(PROMPT_LENGTHS, vocab_size=VOCAB)
    exact = qwen3_5_testing.exact_reference_logits(path, prompts)
    out = []
    for prompt, reference in zip(prompts, exact):
        with torch.no_grad():
            hf_bf16 = hf_model(torch.tensor([prompt], device="cuda")).logits[0, -1]
        out.append((prompt, hf_bf16, reference.cuda()))
    return out


@pytest.mark.parametrize("pins", PINS.values(), ids=PINS.keys())
def test_bf16_last_token_logits_match_transformers(checkpoint, reference_logits, pins):
    """qllm in bf16 against transformers in exact fp32 on the same weights: cosine >= 0.999
    and the same argmax. transformers in bf16 is reported beside it but is not the oracle."""
    path, _ = checkpoint
    llm = LLM(path, enforce_eager=True, kernels=pins, **ENGINE)
    report, failures = [], []
    for prompt, hf_bf16, exact in reference_logits:
        got = prefill_logits(llm, prompt)[-1]
        cosine = _cosine(got, exact)
        gap = _gap_in_std(exact, got.argmax())
        report.append(f"{len(prompt)} tokens: qllm-bf16/exact {cosine:.5f}, "
                      f"hf-bf16/exact {_cosine(hf_bf16, exact):.5f}, "
                      f"qllm-bf16/hf-bf16 {_cosine(got, hf_bf16):.5f}; argmax "
                      + ("equal" if gap == 0 else f"differs, exact gap {gap:.3f} std")
                      + f" (transformers-bf16: {_gap_in_std(exact, hf_bf16.argmax()):.3f} std)")
        if cosine < 0.999 or gap > TIE_STD:
            failures.append(report[-1])
    print("\n".join(report))
    assert not failures, "; ".join(failures)
    assert_cache_free(llm)


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=0).item()


def _gap_in_std(exact: torch.Tensor, chosen: torch.Tensor) -> float:
    """How far below the exact maximum the exact logit of the ``chosen`` token lies, in
    standard deviations of the exact logits: 0 when the argmax agrees."""
    exact = exact.float()
    return ((exact.max() - exact[chosen]) / exact.std()).item()


def test_bf16_compiled_decode_logits_match_eager(checkpoint):
    """CUDA-graph decode with the kernel plugins against eager decode, teacher-forced on the
    eager engine's greedy tokens (16 prompts x 24 steps), so both see the same inputs at every
    step: logits cosine >= 0.999 on average and >= ``TWO_ROUNDINGS_COSINE`` per row, and the
    same argmax unless the eager top two are within ``TIE_STD``. Free-running greedy outputs
    are no check here: at this geometry a bf16 rounding difference flips an expert choice now
    and then, and the continuations drift apart after the first near-tie."""
    path, _ = checkpoint
    prompts = random_prompts([5 + 53 * i for i in range(16)], vocab_size=VOCAB)
    eager = LLM(path, enforce_eager=True, **ENGINE)
    greedy = eager.generate(prompts, SamplingParams(temperature=0, max_tokens=24,
                                                    ignore_eos=True), use_tqdm=False)
    forced = [out["token_ids"] for out in greedy]
    expected = teacher_forced_logits(eager, prompts, forced)  # [steps, B, V]
    compiled = LLM(path, **ENGINE)
    assert compiled.engine.runner.graphs is not None
    got = teacher_forced_logits(compiled, prompts, forced)
    cosine = torch.nn.functional.cosine_similarity(got, expected, dim=-1)  # [steps, B]
    top2 = expected.topk(2, dim=-1).values
    decisive = (top2[..., 0] - top2[..., 1]) > TIE_STD * expected.std(dim=-1)
    mismatched = (got.argmax(-1) != expected.argmax(-1)) & decisive
    print(f"compiled vs eager decode logits: cosine min {cosine.min():.5f}, "
          f"mean {cosine.mean():.5f}; argmax differs at {int(mismatched.sum())} decisive and "
          f"{int(((got.argmax(-1) != expected.argmax(-1)) & ~decisive).sum())} near-tie "
          f"rows of {cosine.numel()}")
    assert cosine.mean() >= 0.999
    assert cosine.min() >= TWO_ROUNDINGS_COSINE
    assert not mismatched.any()
    assert_cache_free(compiled)


def test_bf16_prefill_graph_logits_match_eager(checkpoint):
    """A prompt's prefill through the CUDA graph of its token bucket (padded with an inert
    row; none left for 16 and 512 tokens) against the eager prefill: last-token logits within
    ``TWO_ROUNDINGS_COSINE``, the same argmax unless the eager top two are within
    ``TIE_STD``."""
    path, _ = checkpoint
    prompts = random_prompts([5, 16, 100, 300, 512], vocab_size=VOCAB)
    eager = LLM(path, enforce_eager=True, warm_up=False, **ENGINE)
    expected = torch.stack([last_token_logits(eager, prompt) for prompt in prompts])  # [P, V]
    del eager
    compiled = LLM(path, warm_up=False, **ENGINE)
    graphs = compiled.engine.runner.prefill_graphs
    assert graphs is not None and graphs.sizes[-1] == 512
    got = torch.stack([last_token_logits(compiled, prompt) for prompt in prompts])
    cosine = torch.nn.functional.cosine_similarity(got, expected, dim=-1)  # [P]
    top2 = expected.topk(2, dim=-1).values
    decisive = (top2[:, 0] - top2[:, 1]) > TIE_STD * expected.std(dim=-1)
    print(f"prefill graph vs eager last-token logits: cosine {cosine.tolist()}")
    assert cosine.min() >= TWO_ROUNDINGS_COSINE
    assert not ((got.argmax(-1) != expected.argmax(-1)) & decisive).any()
    assert_cache_free(compiled)


def test_prefill_with_a_host_sync_runs_without_graphs(tmp_path):
    """A prefill path that reads a device value on the host (the plain-torch MoE reference
    counts tokens per expert) cannot be captured: the engine says so and prefills eagerly,
    one request at a time here, with the same greedy tokens as eager in fp32."""
    qwen3_5_testing.save_checkpoint("qwen3_5_moe", str(tmp_path), max_position_embeddings=2048)
    prompts = random_prompts([5, 16, 100, 512, 700], vocab_size=512)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    engine = dict(dtype="float32", device="cuda", max_num_seqs=1, max_model_len=2048,
                  kv_cache_memory_bytes=1 << 30, kernels={"fused_moe": "torch"})
    expected = LLM(str(tmp_path), enforce_eager=True, **engine).generate(prompts, params,
                                                                        use_tqdm=False)
    compiled = LLM(str(tmp_path), **engine)
    assert compiled.engine.runner.graphs is not None
    assert compiled.engine.runner.prefill_graphs is None
    assert_same_tokens(compiled.generate(prompts, params, use_tqdm=False), expected)
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


def test_compiling_ahead_changes_no_token(tmp_path, monkeypatch):
    """A tiny hybrid MoE in bf16, every op on a plugin's kernel: the engine whose graph
    buckets' and warm-up's Triton kernels compiled ahead in threads (``QLLM_COMPILE_AHEAD=1``:
    passes that launch no Triton kernel) decodes the tokens of one that compiled them as it
    went."""
    qwen3_5_testing.save_checkpoint("qwen3_5_moe", str(tmp_path), max_position_embeddings=2048)
    prompts = random_prompts([5 + 29 * i for i in range(16)], vocab_size=512)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    engine = dict(dtype="bfloat16", device="cuda", max_num_seqs=16, max_model_len=2048,
                  kv_cache_memory_bytes=1 << 30)
    monkeypatch.setenv("QLLM_COMPILE_AHEAD", "0")
    expected = LLM(str(tmp_path), **engine).generate(prompts, params, use_tqdm=False)
    monkeypatch.setenv("QLLM_COMPILE_AHEAD", "1")
    ahead = LLM(str(tmp_path), **engine)
    assert ahead.engine.compile_ahead, ahead.engine.kernels.names()
    assert_same_tokens(ahead.generate(prompts, params, use_tqdm=False), expected)
    assert_cache_free(ahead)
