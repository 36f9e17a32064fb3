"""Configs that transformers accepts beyond the released checkpoints' geometry run with parity
on tiny random checkpoints: a shared expert of the routed experts' size (run inside the
``fused_moe`` op) or of another size (run as its own MLP), and biased attention projections.
fp32 on the CPU against transformers; bf16 on CUDA through the kernel plugins."""

from __future__ import annotations

import pytest
import torch

from qllm import LLM, SamplingParams
from qllm.engine.diagnostics import teacher_forced_logits
from qllm.testing import assert_cache_free, prefill_logits, random_prompts

qwen3_5_testing = pytest.importorskip("qllm_qwen3_5.testing")
qwen3_5_moe = pytest.importorskip("qllm_qwen3_5.moe")

MAX_TOKENS = 24
PROMPTS = random_prompts([3, 17, 100], seed=7)  # the longest spans more than one GDN chunk
ENGINE = dict(device="cpu", block_size=16, max_model_len=160, num_kv_blocks=48)
ROUTED_SIZE = qwen3_5_testing.MOE["moe_intermediate_size"]
SHARED_SIZES = pytest.mark.parametrize("shared_size", [ROUTED_SIZE, ROUTED_SIZE + 16],
                                       ids=["shared-fused", "shared-separate"])


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def assert_matches_transformers(llm: LLM, model: torch.nn.Module) -> None:
    """Prefill logits of the longest prompt close to transformers', greedy tokens equal."""
    expected = qwen3_5_testing.hf_logits(model, PROMPTS[-1])  # [T, V]
    torch.testing.assert_close(prefill_logits(llm, PROMPTS[-1]), expected, atol=1e-4, rtol=0)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                   ignore_eos=True), use_tqdm=False)
    reference = qwen3_5_testing.hf_greedy(model, PROMPTS, MAX_TOKENS)
    for prompt, out, ref in zip(PROMPTS, outputs, reference):
        assert out["token_ids"] == ref, f"prompt of {len(prompt)} tokens diverged"
    assert_cache_free(llm)


def moe_blocks(llm: LLM) -> list:
    """The engine model's ``SparseMoeBlock``s."""
    return [m for m in llm.engine.model.modules() if isinstance(m, qwen3_5_moe.SparseMoeBlock)]


@SHARED_SIZES
@pytest.mark.parametrize("kind", ["qwen3_5_moe", "qwen3_next"])
def test_shared_expert_of_any_size_matches_transformers(tmp_path, kind, shared_size):
    """The fused path for a shared expert of the routed size, the separate one otherwise."""
    model = qwen3_5_testing.save_checkpoint(kind, str(tmp_path),
                                            shared_expert_intermediate_size=shared_size)
    llm = LLM(str(tmp_path), **ENGINE)
    blocks = moe_blocks(llm)
    assert blocks and all(b.shared_expert_fused == (shared_size == ROUTED_SIZE)
                          for b in blocks)
    assert_matches_transformers(llm, model)


def test_compiled_decode_with_separate_shared_expert_matches_transformers(tmp_path):
    """The separate shared-expert path inside the compiled decode layers (``fullgraph``)."""
    model = qwen3_5_testing.save_checkpoint("qwen3_next", str(tmp_path),
                                            shared_expert_intermediate_size=ROUTED_SIZE + 16)
    llm = LLM(str(tmp_path), **ENGINE, compile_on_cpu=True)
    assert not any(b.shared_expert_fused for b in moe_blocks(llm))
    assert_matches_transformers(llm, model)


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_attention_bias_matches_transformers(tmp_path, kind):
    """``attention_bias=True``: q/k/v/o projections of the full-attention layers with biases
    (perturbed: transformers initialises them to zero)."""
    model = qwen3_5_testing.build_hf_model(kind, attention_bias=True)
    qwen3_5_testing.perturb_(model, seed=3, names=(".bias",))
    model.save_pretrained(str(tmp_path))
    llm = LLM(str(tmp_path), **ENGINE)
    assert llm.engine.model.model.layers[3].self_attn.o_proj.bias is not None
    assert_matches_transformers(llm, model)


# ----------------------------------------------------------------------------- CUDA

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
CUDA_ENGINE = dict(dtype="bfloat16", device="cuda", max_num_seqs=4, max_model_len=160,
                   kv_cache_memory_bytes=1 << 28)


def cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Cosine similarity over the last dim, in fp32 on the host."""
    return torch.nn.functional.cosine_similarity(a.float().cpu(), b.float().cpu(), dim=-1)


@pytest.mark.cuda
@needs_cuda
@SHARED_SIZES
@pytest.mark.parametrize("kind", ["qwen3_5_moe", "qwen3_next"])
def test_shared_expert_bf16_logits_on_cuda_kernels(tmp_path, kind, shared_size):
    """The Triton fused MoE and router, with the shared expert as their last slot or as its own
    MLP beside them, and the ``add_rms_norm`` kernel summing the slots: bf16 last-token logits
    within cosine 0.999 of transformers' fp32 ones."""
    qwen3_5_testing.save_checkpoint(kind, str(tmp_path),
                                    shared_expert_intermediate_size=shared_size)
    llm = LLM(str(tmp_path), enforce_eager=True, **CUDA_ENGINE)
    assert llm.engine.kernels.names()["fused_moe"] == "triton"
    # transformers in a child process that blocks fla (here it would run fla on the CPU)
    expected = qwen3_5_testing.exact_reference_logits(str(tmp_path), PROMPTS)
    cosines = [cosine(prefill_logits(llm, p)[-1], reference)
               for p, reference in zip(PROMPTS, expected)]
    print(f"{kind} shared {shared_size}: cosines {[f'{c:.5f}' for c in cosines]}")
    assert min(cosines) >= 0.999
    assert_cache_free(llm)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("kind", ["qwen3_5_moe", "qwen3_next"])
def test_separate_shared_expert_cuda_graph_decode_matches_eager(tmp_path, kind):
    """The separate shared-expert path captured in the CUDA-graph decode step: teacher-forced
    on eager's greedy tokens, logits within cosine 0.999 of eager's."""
    qwen3_5_testing.save_checkpoint(kind, str(tmp_path),
                                    shared_expert_intermediate_size=ROUTED_SIZE + 16)
    eager = LLM(str(tmp_path), enforce_eager=True, **CUDA_ENGINE)
    greedy = eager.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                    ignore_eos=True), use_tqdm=False)
    forced = [out["token_ids"] for out in greedy]
    compiled = LLM(str(tmp_path), **CUDA_ENGINE)
    assert compiled.engine.runner.graphs is not None
    cosines = cosine(teacher_forced_logits(compiled, PROMPTS, forced),
                     teacher_forced_logits(eager, PROMPTS, forced))  # [steps, B]
    print(f"{kind}: compiled vs eager cosine min {cosines.min():.5f}")
    assert cosines.min() >= 0.999
    assert_cache_free(compiled)
