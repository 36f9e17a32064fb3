"""Bad input gets a clear error naming the problem, and the engine stays usable after it."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from qllm import LLM, SamplingParams
from qllm.model.loader import CheckpointError
from qllm.plugins.registry import UnknownArchitectureError
from qllm.testing import assert_cache_free, random_prompts

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


@pytest.mark.parametrize("prompts, message", [
    pytest.param({"text": "Hello"}, "a prompt dict takes", id="prompt-dict-without-prompt"),
    pytest.param(None, "prompts must be", id="None"),
    pytest.param(5, "prompts must be", id="an-int"),
])
def test_careless_prompts_raise_type_error(llm, baseline, prompts, message):
    """A dict once generated for its keys (the word "prompt"), None failed deep inside."""
    with pytest.raises(TypeError, match=message):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    still_works(llm, baseline)


@pytest.mark.parametrize("params", [
    pytest.param({"temperature": 0, "max_tokens": 4}, id="a-dict"),
    pytest.param([{"temperature": 0}], id="a-list-of-dicts"),
    pytest.param("greedy", id="a-string"),
])
def test_sampling_params_of_the_wrong_kind(llm, baseline, params):
    with pytest.raises(TypeError, match="sampling_params must be a SamplingParams"):
        llm.generate(random_prompts([5]), params, use_tqdm=False)
    still_works(llm, baseline)


@pytest.mark.parametrize("options, error, message", [
    pytest.param({"temperature": float("nan")}, ValueError, "temperature must be a finite",
                 id="nan-temperature"),
    pytest.param({"temperature": float("inf")}, ValueError, "temperature must be a finite",
                 id="inf-temperature"),
    pytest.param({"top_p": float("nan")}, ValueError, "top_p must be a finite", id="nan-top_p"),
    pytest.param({"stop": 5}, TypeError, "stop must be of type", id="stop-an-int"),
    pytest.param({"stop": ["a", 5]}, TypeError, "stop must be of type", id="stop-with-an-int"),
    pytest.param({"stop_token_ids": 7}, TypeError, "stop_token_ids", id="stop_token_ids-int"),
    pytest.param({"max_tokens": "5"}, TypeError, "max_tokens", id="max_tokens-a-string"),
    pytest.param({"top_k": 2.0}, TypeError, "top_k", id="top_k-a-float"),
    pytest.param({"temperature": True}, TypeError, "temperature", id="temperature-a-bool"),
    pytest.param({"ignore_eos": "yes"}, TypeError, "ignore_eos", id="ignore_eos-a-string"),
])
def test_bad_sampling_types_and_non_finite_numbers(options, error, message):
    with pytest.raises(error, match=message):
        SamplingParams(**options)


@pytest.mark.parametrize("options, error, message", [
    pytest.param({"max_model_len": "4096"}, TypeError, "max_model_len must be of type",
                 id="max_model_len-a-string"),
    pytest.param({"block_size": 16.0}, TypeError, "block_size", id="block_size-a-float"),
    pytest.param({"enforce_eager": "yes"}, TypeError, "enforce_eager", id="flag-a-string"),
    pytest.param({"kernels": {"linear": 1}}, TypeError, "kernels", id="kernels-bad-value"),
    pytest.param({"cudagraph_batch_sizes": "1,2"}, TypeError, "cudagraph_batch_sizes",
                 id="batch-sizes-a-string"),
    pytest.param({"prefill_cudagraph_token_sizes": (16, 100)}, ValueError,
                 "prefill_cudagraph_token_sizes must be positive multiples of 16",
                 id="prefill-graph-size-off-16"),
    pytest.param({"dtype": 16}, TypeError, "dtype", id="dtype-an-int"),
    pytest.param({"gpu_memory_utilization": float("nan")}, ValueError,
                 "gpu_memory_utilization must be a finite", id="nan-memory-utilization"),
    pytest.param({"kv_cache_memory_bytes": 0}, ValueError, "kv_cache_memory_bytes",
                 id="no-cache-memory"),
    pytest.param({"device": "gpu"}, ValueError, "device must be 'cpu', 'cuda'", id="gpu"),
])
def test_engine_options_of_the_wrong_type_or_range(qwen3_dir, options, error, message):
    with pytest.raises(error, match=message):
        LLM(qwen3_dir, **options)


def test_cuda_without_cuda_is_a_clear_error(qwen3_dir, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="device 'cuda' is not available"):
        LLM(qwen3_dir, device="cuda")


def test_dtype_auto_is_the_checkpoints(qwen3_dir, tmp_path):
    """"auto" runs in the dtype config.json records (as transformers and vLLM read it); the
    default stays fp32 on the CPU."""
    shutil.copytree(qwen3_dir, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["dtype"] = "bfloat16"
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    llm = LLM(str(tmp_path / "m"), dtype="auto", block_size=16, max_model_len=64)
    assert llm.engine.config.dtype == torch.bfloat16
    assert len(llm.generate(random_prompts([5]), GREEDY, use_tqdm=False)[0]["token_ids"]) == 4
    default = LLM(str(tmp_path / "m"), block_size=16, max_model_len=64)
    assert default.engine.config.dtype == torch.float32


@pytest.fixture(scope="module")
def chat_llm(qwen3_tokenizer_model_dir):
    return LLM(qwen3_tokenizer_model_dir, block_size=16, max_model_len=256)


USER = {"role": "user", "content": "Write a haiku"}


@pytest.mark.parametrize("conversation, message", [
    pytest.param([{"role": "user"}], "messages\\[0\\].content must be a string",
                 id="no-content"),
    pytest.param([{"role": "user", "content": None}], "messages\\[0\\].content",
                 id="null-content"),
    pytest.param([USER, {"role": "wizard", "content": "hi"}], "messages\\[1\\].role",
                 id="unknown-role"),
    pytest.param([{"content": "hi"}], "messages\\[0\\].role", id="no-role"),
    pytest.param([USER, "hi"], "messages\\[1\\] must be a dict", id="a-string-message"),
])
def test_bad_chat_messages_are_not_dropped_silently(chat_llm, conversation, message):
    """The chat template skipped such messages and generated for the rest."""
    with pytest.raises(ValueError, match=message):
        chat_llm.chat(conversation, GREEDY, use_tqdm=False)
    assert len(chat_llm.chat([USER], GREEDY, use_tqdm=False)[0]["token_ids"]) == 4
    assert_cache_free(chat_llm)


def test_developer_message_is_rendered_as_system(chat_llm):
    """Qwen's template knows no "developer" role (OpenAI's newer name for "system") and
    dropped the message."""
    def prompt(role):
        messages = [{"role": role, "content": "Answer in French."}, USER]
        return chat_llm.chat(messages, GREEDY, use_tqdm=False)[0]["prompt_token_ids"]

    assert prompt("developer") == prompt("system") != chat_llm.chat(
        [USER], GREEDY, use_tqdm=False)[0]["prompt_token_ids"]


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


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
def test_log_probs_past_the_vocabulary(llm, baseline, field):
    """As many log-probs as the vocabulary holds are served; more are refused before anything
    runs (logprobs failed the step's unpacking, and the step after it in the next call too;
    prompt_logprobs failed the step), the requests before the bad one queued by no one."""
    vocab = llm.engine.vocab_size
    whole = llm.generate(random_prompts([3]), SamplingParams(max_tokens=1, **{field: vocab}),
                         use_tqdm=False)[0]
    listed = whole["logprobs"][0] if field == "logprobs" else whole["prompt_logprobs"][1]
    assert len(listed) == vocab
    with pytest.raises(ValueError, match=f"{field} must be at most the vocabulary size "
                                         f"\\({vocab}\\), got {vocab + 1}"):
        llm.generate(random_prompts([5, 6]), [GREEDY, SamplingParams(**{field: vocab + 1})],
                     use_tqdm=False)
    assert not llm.engine.sequences
    still_works(llm, baseline)


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


def test_model_path_to_a_file_asks_for_its_directory(qwen3_dir):
    with pytest.raises(NotADirectoryError, match="not a directory"):
        LLM(os.path.join(qwen3_dir, "config.json"))


def test_hugging_face_repo_name_says_only_local_directories(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="serves only local directories") as info:
        LLM("Qwen/Qwen3-0.6B")
    assert "hf download Qwen/Qwen3-0.6B" in str(info.value)


def test_unknown_architecture_lists_installed_plugins(qwen3_dir, tmp_path):
    shutil.copytree(qwen3_dir, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["architectures"] = ["MysteryForCausalLM"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnknownArchitectureError, match="MysteryForCausalLM") as info:
        LLM(str(tmp_path / "m"))
    assert "qllm-qwen3: Qwen3ASRForConditionalGeneration, Qwen3ForCausalLM" in str(info.value)
    assert "pip install -e plugins/qwen3" in str(info.value)  # not a PyPI name


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
