"""Plugins from outside qllm's tree, found through their ``qllm`` entry points as a user's are:
the plugin guide's example model plugin (Llama, ``docs/examples/qllm-example-llama``) and
example kernel plugin (the ``linear`` op on the CPU, ``docs/examples/qllm-example-kernels``),
pip-installed into a temporary directory put on ``sys.path``. qllm's greedy tokens for the
example Llama equal transformers', on the reference kernels and on the example kernel."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qllm import LLM, SamplingParams
from qllm.plugins.protocols import CacheLayer, CausalLMModel, DecoderLayer
from qllm.plugins.registry import PluginRegistry
from qllm.testing import hf_greedy, perturb_, random_prompts

EXAMPLES = Path(__file__).resolve().parent.parent / "docs" / "examples"
PACKAGES = ("qllm-example-llama", "qllm-example-kernels")
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
ENGINE = dict(block_size=16, max_model_len=128, num_kv_blocks=32)


@pytest.fixture(scope="module")
def example_registry(tmp_path_factory):
    """A ``PluginRegistry`` loading every ``qllm`` entry point on ``sys.path`` with the two
    example packages installed (``pip install --target``, from copies: a build writes into
    its source tree)."""
    target = tmp_path_factory.mktemp("site-packages")
    sources = tmp_path_factory.mktemp("sources")
    for name in PACKAGES:
        shutil.copytree(EXAMPLES / name, sources / name)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    "--no-build-isolation", "--disable-pip-version-check", "--target",
                    str(target), *(str(sources / name) for name in PACKAGES)],
                   check=True, capture_output=True, timeout=300)
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(target))
        yield PluginRegistry()


@pytest.fixture(scope="module")
def llama_checkpoint(tmp_path_factory):
    """``(directory, transformers model)`` of a tiny random Llama, its norms and query / key
    projections perturbed: at the initial scale the attention is near uniform, blind to
    positions."""
    import transformers

    path = tmp_path_factory.mktemp("llama")
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    perturb_(model, names=("norm", "q_proj", "k_proj"))
    model.save_pretrained(path)
    return str(path), model


@pytest.fixture(scope="module")
def expected(llama_checkpoint):
    """Prompts and transformers' greedy continuations of them."""
    prompts = random_prompts([5, 17, 40])
    return prompts, [hf_greedy(llama_checkpoint[1], p, GREEDY.max_tokens) for p in prompts]


def test_entry_points_register_the_examples(example_registry):
    assert example_registry.models["LlamaForCausalLM"].plugin == "qllm-example-llama"
    names = example_registry.kernels(torch.device("cpu"), torch.float32).names()
    assert names["linear"] == "example-addmm"
    assert example_registry.kernels(torch.device("cpu"), torch.bfloat16).names()["linear"] \
        == "torch"  # the example kernel claims fp32 alone


@pytest.mark.parametrize("linear", ["torch", "example-addmm"])
def test_example_llama_matches_transformers(example_registry, llama_checkpoint, expected,
                                            linear):
    prompts, tokens = expected
    llm = LLM(llama_checkpoint[0], plugins=example_registry, kernels={"linear": linear},
              **ENGINE)
    assert llm.engine.kernels.names()["linear"] == linear
    model = llm.engine.model
    assert isinstance(model, CausalLMModel)
    assert all(isinstance(layer, DecoderLayer) for layer in model.decoder_layers())
    assert [layer.layer_kind for layer in model.cache_layers()] == ["full_attention"] * 2
    assert all(isinstance(layer, CacheLayer) for layer in model.cache_layers())
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [out["token_ids"] for out in outputs] == tokens
