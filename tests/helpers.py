"""Test helpers: tiny random Qwen3 checkpoints written by transformers (with perturbed weights),
random prompts, transformers' greedy reference, the cache-leak check, and decode graphs on the
CPU."""

from __future__ import annotations

import pytest
import torch

from qllm import SamplingParams
from qllm.engine.scheduler import ScheduledBatch
from qllm.engine.sequence import Sequence
from qllm.runner.cuda_graphs import DecodeGraphs


def require_qwen3_plugin() -> None:
    """The core's own tests run without plugins; those that need Qwen3 skip then."""
    pytest.importorskip("qllm_qwen3", reason="the qllm-qwen3 plugin is not installed")


def perturb_(model: torch.nn.Module, names=("norm",), scale: float = 0.3, seed: int = 0) -> None:
    """Add N(0, scale) noise to parameters whose name contains one of ``names``: freshly
    initialised norm weights are constants, which hide norm bugs."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if any(key in name for key in names):
                param.add_(torch.randn(param.shape, generator=generator) * scale)


def tiny_qwen3_config(**overrides):
    import transformers

    settings = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    max_position_embeddings=1024, tie_word_embeddings=False,
                    eos_token_id=1, bos_token_id=0)
    settings.update(overrides)
    return transformers.Qwen3Config(**settings)


def save_tiny_qwen3(path, seed: int = 0, **overrides):
    """Write a tiny Qwen3 checkpoint to ``path``; returns the transformers model (fp32, eval)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(tiny_qwen3_config(**overrides)).eval()
    perturb_(model, seed=seed)
    model.save_pretrained(path)
    return model


def random_prompts(lengths, vocab_size: int = 512, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation of one prompt (no padding, EOS ignored)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    tokens = out[0, len(prompt):].tolist()
    assert len(tokens) == max_new_tokens
    return tokens


def assert_cache_free(llm) -> None:
    """Every block and slot of every cache pool is back in its free pool."""
    cache = llm.engine.cache
    assert cache.all_free(), f"cache leak: {cache.usage()}"
    assert not llm.engine.scheduler.running and not llm.engine.scheduler.waiting


def prefill_logits(llm, prompt: list[int]) -> torch.Tensor:
    """qllm's logits ``[T, V]`` (as fp32) at every position of ``prompt`` in one prefill step."""
    engine = llm.engine
    engine.cache.reset_prefix_cache()  # a cached prefix would leave only the tail to compute
    seq = Sequence(prompt, SamplingParams(temperature=0))
    assert engine.cache.admit(seq) and engine.cache.reserve(seq, len(prompt))
    assert seq.num_computed_tokens == 0
    try:
        input_ids, positions, batch = engine.runner.prepare(
            ScheduledBatch([seq], [len(prompt)], is_prefill=True))
        with torch.inference_mode():
            hidden = engine.model(input_ids, positions, batch)
            return engine.model.compute_logits(hidden).float()
    finally:
        engine.cache.release(seq)


def assert_same_tokens(got: list[dict], expected: list[dict]) -> None:
    """Every output's token ids equal the expected ones; the message says where each of the
    differing outputs first diverges."""
    diverged = {}
    for i, (g, e) in enumerate(zip(got, expected)):
        pairs = list(zip(g["token_ids"], e["token_ids"]))
        first = next((j for j, (a, b) in enumerate(pairs) if a != b), None)
        if first is not None or len(g["token_ids"]) != len(e["token_ids"]):
            diverged[i] = first
    assert not diverged, (f"{len(diverged)} of {len(expected)} outputs differ; "
                          f"first differing token per output: {diverged}")


def assert_greedy_equal_up_to_ties(reference_llm, prompts: list[list[int]], got: list[dict],
                                   expected: list[dict], tolerance: float = 0.1) -> None:
    """Greedy outputs ``got`` equal ``expected`` (from ``reference_llm``) except where, at the
    first differing token, the two choices are a numerical tie by ``reference_llm``'s own
    logits: their gap is within ``tolerance`` standard deviations of those logits. Low
    precision reorders near-equal logits; a wrong cache slot or stale state does not produce
    ties."""
    ties, failures = [], []
    for i, (prompt, g, e) in enumerate(zip(prompts, got, expected)):
        first = next((j for j, (a, b) in enumerate(zip(g["token_ids"], e["token_ids"]))
                      if a != b), None)
        if first is None:
            assert g["token_ids"] == e["token_ids"]
            continue
        logits = prefill_logits(reference_llm, prompt + e["token_ids"][:first])[-1].float()
        gap = (logits[e["token_ids"][first]] - logits[g["token_ids"][first]]).item()
        entry = f"output {i} at token {first}: gap {gap:.4f} ({gap / logits.std():.3f} std)"
        (ties if gap <= tolerance * logits.std() else failures).append(entry)
    assert not failures, f"divergences that are not ties: {failures}; ties: {ties}"
    print(f"{len(prompts) - len(ties)} of {len(prompts)} outputs identical; ties: {ties}")


class RerunGraph:
    """Replays like a CUDA graph would: same static inputs in, same output tensor written."""

    def __init__(self, fn, output: torch.Tensor):
        self.fn, self.output = fn, output

    def replay(self) -> None:
        self.output.copy_(self.fn())


def rerun_capture(fn):
    output = fn()
    return RerunGraph(fn, output), output


def with_decode_graphs(llm, sizes: list[int]):
    """``llm`` with its runner's decode "graphs" for batch ``sizes`` captured by
    ``rerun_capture``, so CPU decode steps take the CUDA-graph path: padded to a bucket,
    staged in the fixed layout, copied into the bucket's static inputs."""
    runner = llm.engine.runner
    dummy = ScheduledBatch([], [], is_prefill=False)
    with torch.inference_mode():
        runner.graphs = DecodeGraphs(
            runner._decode_logits,
            lambda size: runner.prepare(dummy, pad_to=size, fixed_layout=True),
            sizes, rerun_capture)
    return llm
