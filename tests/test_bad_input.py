"""Bad input gets a clear error naming the problem, and the engine stays usable after it."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from safetensors.torch import load_file, save_file

from helpers import assert_cache_free, random_prompts
from qllm import LLM, SamplingParams
from qllm.loader import CheckpointError
from qllm.plugins import UnknownArchitectureError

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    return LLM(qwen3_dir, block_size=16, max_model_len=128)


@pytest.fixture(scope="module")
def baseline(llm):
    return llm.generate(random_prompts([12]), GREEDY, use_tqdm=False)[0]["token_ids"]


def still_works(llm, baseline):
    assert llm.generate(random_prompts([12]), GREEDY, use_tqdm=False)[0]["token_ids"] == baseline
    assert_cache_free(llm)


@pytest.mark.parametrize("prompts, message", [
    pytest.param([[]], "empty", id="empty-prompt"),
    pytest.param([[5] * 128], "max_model_len", id="prompt-too-long"),
    pytest.param([[5, 10_000]], "outside the vocabulary", id="token-out-of-vocab"),
    pytest.param([[5, 6], []], "empty", id="one-bad-prompt-among-good"),
    pytest.param(["text"], "no tokenizer", id="text-without-tokenizer"),
    pytest.param([[1.5]], "token ids", id="non-integer-token"),
])
def test_bad_prompts(llm, baseline, prompts, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    still_works(llm, baseline)


@pytest.mark.parametrize("options, message", [
    pytest.param({"max_tokens": 0}, "max_tokens", id="max_tokens-0"),
    pytest.param({"temperature": -0.1}, "temperature", id="negative-temperature"),
    pytest.param({"top_p": 0.0}, "top_p", id="top_p-0"),
    pytest.param({"top_p": 1.5}, "top_p", id="top_p-above-1"),
    pytest.param({"top_k": 0}, "top_k", id="top_k-0"),
    pytest.param({"top_k": -2}, "top_k", id="top_k-below-minus-1"),
    pytest.param({"stop": [""]}, "stop", id="empty-stop-string"),
    pytest.param({"seed": 2**64}, "seed", id="seed-past-64-bits"),
    pytest.param({"seed": -1}, "seed", id="negative-seed"),
])
def test_bad_sampling_values(options, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**options)


def test_top_k_past_the_vocabulary_keeps_every_token(llm, baseline):
    """Any ``top_k`` of at least the vocabulary size samples like no top-k at all, even one
    past 64 bits (it reached the sampler's int64 tensor as is, and failed the step)."""
    prompts = random_prompts([9, 5])
    unfiltered = llm.generate(prompts, SamplingParams(temperature=1.0, seed=7, max_tokens=6,
                                                      ignore_eos=True), use_tqdm=False)
    for top_k in (llm.engine.vocab_size, 2**63, 2**70):
        params = SamplingParams(temperature=1.0, top_k=top_k, seed=7, max_tokens=6,
                                ignore_eos=True)
        assert llm.generate(prompts, params, use_tqdm=False) == unfiltered
    still_works(llm, baseline)


def test_mismatched_sampling_params_count(llm, baseline):
    with pytest.raises(ValueError, match="sampling params"):
        llm.generate(random_prompts([3, 4]), [GREEDY], use_tqdm=False)
    still_works(llm, baseline)


def test_unknown_keyword_raises_type_error(qwen3_dir):
    with pytest.raises(TypeError, match="max_num_seq"):
        LLM(qwen3_dir, max_num_seq=4)


def test_missing_model_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(str(tmp_path / "nowhere"))


def test_unknown_architecture_lists_installed_plugins(qwen3_dir, tmp_path):
    shutil.copytree(qwen3_dir, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["architectures"] = ["MysteryForCausalLM"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnknownArchitectureError, match="MysteryForCausalLM") as info:
        LLM(str(tmp_path / "m"))
    assert "qllm-qwen3: Qwen3ForCausalLM" in str(info.value)


def copy_with_weights(src, dst, mutate) -> str:
    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    tensors = load_file(path)
    mutate(tensors)
    save_file(tensors, path, metadata={"format": "pt"})
    return str(dst)


@pytest.mark.parametrize("mutate, message", [
    pytest.param(lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"),
                 "model.layers.1.self_attn.qkv_proj.weight \\(k shard\\)", id="missing-tensor"),
    pytest.param(lambda t: t.update({"model.layers.0.extra.weight": t["model.norm.weight"].clone()}),
                 "model.layers.0.extra.weight", id="unexpected-tensor"),
    pytest.param(lambda t: t.update({"model.norm.weight": t["model.norm.weight"][:-1]}),
                 "model.norm.weight", id="mis-shaped-tensor"),
])
def test_checkpoint_that_does_not_fit(qwen3_dir, tmp_path, mutate, message):
    with pytest.raises(CheckpointError, match=message):
        LLM(copy_with_weights(qwen3_dir, tmp_path / "m", mutate))


@pytest.mark.parametrize("damage", [
    pytest.param(lambda data: data[: len(data) // 2], id="truncated"),
    pytest.param(lambda data: b"\x00garbage" + data[8:], id="corrupt-header"),
])
def test_corrupt_safetensors(qwen3_dir, tmp_path, damage):
    shutil.copytree(qwen3_dir, tmp_path / "m")
    path = tmp_path / "m" / "model.safetensors"
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(CheckpointError, match="model.safetensors"):
        LLM(str(tmp_path / "m"))


def test_missing_weights_suggest_dummy(qwen3_dir, tmp_path):
    shutil.copytree(qwen3_dir, tmp_path / "m")
    os.remove(tmp_path / "m" / "model.safetensors")
    with pytest.raises(CheckpointError, match="load_format='dummy'"):
        LLM(str(tmp_path / "m"))
    llm = LLM(str(tmp_path / "m"), load_format="dummy", block_size=16, max_model_len=64)
    assert len(llm.generate(random_prompts([5]), GREEDY, use_tqdm=False)[0]["token_ids"]) == 4


def test_max_model_len_beyond_the_model(qwen3_dir):
    with pytest.raises(ValueError, match="max_position_embeddings"):
        LLM(qwen3_dir, max_model_len=100_000)
