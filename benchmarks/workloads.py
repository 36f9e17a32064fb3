"""The benchmark workloads of shared/bench/WORKLOADS.md: model geometries (written as a
config.json for ``load_format="dummy"``), prompts and sampling settings, shared by the
harnesses in this folder."""

from __future__ import annotations

import json
import os
import random
import subprocess
import tempfile

QWEN3_0_6B = dict(
    architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=1024,
    intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
    head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, hidden_act="silu",
    attention_bias=False, dtype="bfloat16", eos_token_id=151645, bos_token_id=151643)

QWEN3_5_35B_A3B = dict(architectures=["Qwen3_5MoeForCausalLM"], model_type="qwen3_5_moe_text",
                       dtype="bfloat16")


def workload(name: str):
    """``(config dict, prompts, per-prompt (max_tokens, temperature))`` of a workload."""
    random.seed(0)
    if name == "w1":  # identical to nano-vllm's bench.py
        prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))]
                   for _ in range(256)]
        params = [(random.randint(100, 1024), 0.6) for _ in range(256)]
        return QWEN3_0_6B, prompts, params
    if name == "w2":
        prompts = [[random.randint(0, 9999) for _ in range(1000)] for _ in range(200)]
        return QWEN3_5_35B_A3B, prompts, [(2000, 0.0)] * 200
    if name == "w3":
        prompts = [[random.randint(0, 9999) for _ in range(512)]]
        return QWEN3_5_35B_A3B, prompts, [(256, 0.0)]
    raise ValueError(f"unknown workload {name!r}")


def write_config(config: dict, num_layers: int | None) -> str:
    """A temporary checkpoint directory holding only ``config.json`` (optionally cut to
    ``num_layers`` layers), for ``load_format="dummy"``."""
    path = tempfile.mkdtemp(prefix="qllm-bench-")
    config = dict(config)
    if num_layers:
        config["num_hidden_layers"] = num_layers
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


def commit() -> str:
    """``git describe`` of the working tree (``-dirty`` when it has changes)."""
    try:
        return subprocess.check_output(["git", "describe", "--always", "--dirty"], text=True,
                                       stderr=subprocess.DEVNULL).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
