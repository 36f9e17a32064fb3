"""The persistent compile cache (``qllm.runner.compile_cache``): where it is and how it is
turned off; a second engine, in a fresh process with the same cache folder, loads its
compiled graphs from the cache and generates the same tokens; with the cache off, nothing is
written there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from qllm.runner import compile_cache

CACHE_ENV = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TRITON_CACHE_AUTOTUNING")


def test_cache_root_is_the_setting_else_the_environment_else_the_default(monkeypatch,
                                                                         tmp_path):
    monkeypatch.setenv("QLLM_CACHE_DIR", str(tmp_path / "env"))
    assert compile_cache.cache_root(None) == tmp_path / "env"
    assert compile_cache.cache_root(str(tmp_path / "setting")) == tmp_path / "setting"
    assert compile_cache.cache_root("off") is None
    monkeypatch.setenv("QLLM_CACHE_DIR", "OFF")
    assert compile_cache.cache_root(None) is None
    monkeypatch.setenv("QLLM_CACHE_DIR", "")
    assert compile_cache.cache_root(None) == Path.home() / ".cache" / "qllm"


def test_turning_the_cache_off_puts_back_the_environment_it_replaced(monkeypatch, tmp_path):
    for name in CACHE_ENV:  # monkeypatch restores this process's own values afterwards
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "own"))
    monkeypatch.setattr(compile_cache, "_replaced_env", {})
    cache = compile_cache.configure(str(tmp_path / "qllm"))
    assert cache.folder == tmp_path / "qllm" / compile_cache.versions_folder()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(cache.folder / "inductor")
    assert os.environ["TRITON_CACHE_DIR"] == str(cache.triton_folder)
    assert not compile_cache.configure("off").enabled
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "own")
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ
    assert "TRITON_CACHE_AUTOTUNING" not in os.environ


# One engine with compiled decode (one prompt: prefill regions, then decode of batch 1):
# prints its start-up summary, taken after the request, and the tokens.
LAUNCH = """
import json, sys
from qllm import LLM, SamplingParams
llm = LLM(sys.argv[1], compile_on_cpu=True, compile_cache_dir=sys.argv[2] or None,
          max_num_seqs=2, block_size=16, max_model_len=64, max_num_batched_tokens=64,
          num_kv_blocks=int(sys.argv[3]) if sys.argv[3] else None)
params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
out = llm.generate([[5, 6, 7]], params, use_tqdm=False)
print(json.dumps({"startup": llm.engine.startup.summary(), "tokens": out[0]["token_ids"]}))
"""


def launch(model_dir: str, env: dict[str, str], compile_cache_dir: str = "",
           num_kv_blocks: int | None = None) -> dict:
    """Start an engine in a fresh process (this one's import path, ``env`` on top of this
    environment; ``num_kv_blocks`` or the default); returns what ``LAUNCH`` printed."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), **env}
    done = subprocess.run([sys.executable, "-c", LAUNCH, model_dir, compile_cache_dir,
                           str(num_kv_blocks or "")],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def cold_launch(qwen3_dir, tmp_path_factory):
    """``(QLLM_CACHE_DIR, output)`` of a first launch, into an empty cache folder."""
    root = str(tmp_path_factory.mktemp("qllm-cache"))
    return root, launch(qwen3_dir, {"QLLM_CACHE_DIR": root})


def test_second_launch_loads_compiled_graphs_from_the_cache(qwen3_dir, cold_launch):
    """Every graph hits, with another KV block count too (a launch's count follows the free
    memory): the cache's sizes are symbolic in the compiled layers."""
    root, cold = cold_launch
    warm = launch(qwen3_dir, {"QLLM_CACHE_DIR": root}, num_kv_blocks=13)
    assert cold["startup"]["compile_cache"]["state"] == "cold", cold["startup"]
    assert warm["startup"]["compile_cache"]["state"] == "warm", warm["startup"]
    compiled = cold["startup"]["compile_cache"]["lookups"]["fx_graph"]["misses"]
    assert warm["startup"]["compile_cache"]["lookups"]["fx_graph"]["hits"] == compiled > 0
    assert warm["startup"]["compile_cache"]["dir"].startswith(root)
    assert warm["tokens"] == cold["tokens"]


def test_cache_turned_off_writes_nothing_and_leaves_torch_its_own(qwen3_dir, cold_launch,
                                                                   tmp_path):
    """Off, qllm's cache root stays empty, and torch's own ``TORCHINDUCTOR_CACHE_DIR`` (here
    the folder the first launch filled, so its graphs hit) is the one used."""
    root, cold = cold_launch
    unused = tmp_path / "qllm-cache"
    inductor = os.path.join(cold["startup"]["compile_cache"]["dir"], "inductor")
    off = launch(qwen3_dir, {"QLLM_CACHE_DIR": str(unused),
                             "TORCHINDUCTOR_CACHE_DIR": inductor}, compile_cache_dir="off")
    assert off["startup"]["compile_cache"]["state"] == "off"
    assert off["startup"]["compile_cache"]["lookups"]["fx_graph"]["hits"] > 0
    assert not unused.exists()
    assert off["tokens"] == cold["tokens"]
