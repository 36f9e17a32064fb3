"""Tiny random Qwen3 checkpoints written by transformers (with perturbed weights), random
prompts and transformers' greedy reference: the models the tests of the core and of the
plugins run on."""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def torch_threads(n: int):
    """Run with ``n`` intra-op threads (tiny models are many times faster on one thread; the
    root conftest's ``one_torch_thread`` fixture runs a test module so)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def require_qwen3_plugin() -> None:
    """The core's own tests run without plugins; those that need Qwen3 skip then."""
    import pytest

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
    """A 2-layer Qwen3 config (vocabulary 512, hidden 64, GQA 4/2 heads of 16), with
    ``overrides``."""
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
    """One prompt of random token ids (2 and up: 0 and 1 are BOS and EOS) per length."""
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


