"""compile_launches as graph capture uses it (unless QLLM_COMPILE_AHEAD=0): the switch, and on
CUDA graph buckets whose Triton kernels compiled ahead, the capture compiling nothing more and
the graphs decoding the tokens of an engine that compiled as it captured. The launch-to-compile
mechanism itself is tested through ``compile_ahead`` (tests/test_compile_ahead.py), which
shares it."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest

from qllm.runner.triton_precompile import SWITCH_ENV, compile_ahead_enabled
from qllm.testing.kernels import cuda


PLUGIN_KERNELS = {"fused_moe": "triton", "moe_router": "triton", "linear": "triton"}


def test_on_unless_switched_off_and_every_op_on_a_plugin_kernel(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="qllm.runner.triton_precompile")
    monkeypatch.delenv(SWITCH_ENV, raising=False)
    assert compile_ahead_enabled(PLUGIN_KERNELS)
    monkeypatch.setenv(SWITCH_ENV, "0")
    assert not compile_ahead_enabled(PLUGIN_KERNELS)
    monkeypatch.setenv(SWITCH_ENV, "1")
    # the fused_moe reference would count the experts' slots from unwritten router ids
    assert not compile_ahead_enabled({**PLUGIN_KERNELS, "fused_moe": "torch"})
    assert "ops on their plain-torch references: fused_moe" in caplog.text
    # the draws' reference reads only the logits on the device
    assert compile_ahead_enabled({**PLUGIN_KERNELS, "sample_tokens": "torch"})
    monkeypatch.setenv(SWITCH_ENV, "yes")
    with pytest.raises(ValueError, match=SWITCH_ENV):
        compile_ahead_enabled(PLUGIN_KERNELS)


def test_an_engine_on_the_cpu_never_compiles_ahead(qwen3_dir, monkeypatch):
    from qllm import LLM

    monkeypatch.setenv(SWITCH_ENV, "1")
    engine = LLM(qwen3_dir, device="cpu").engine
    assert not engine.compile_ahead and not engine.runner.compile_ahead


# Builds an engine the way ``LLM`` does, counting Triton's compiles in the graph-kernel pass
# ahead of the capture (absent with QLLM_COMPILE_AHEAD=0) and in the captures themselves,
# then prints them and the tokens it decodes. In a fresh process: Triton keeps the kernels it
# compiled in memory, so an engine built earlier in the same process would have compiled them.
BUILD_AND_DECODE = """
import json, sys
from qllm import LLM, SamplingParams
from qllm.runner.model_runner import ModelRunner
from qllm.runner.triton_compiles import TritonCompileLog
log, compiles = TritonCompileLog().start(), {}
def counted(name, method):
    def count_compiles(self, *args):
        before = log.summary()["compiled"]
        result = method(self, *args)
        compiles[name] = compiles.get(name, 0) + log.summary()["compiled"] - before
        return result
    return count_compiles
ModelRunner.compile_graph_kernels = counted("ahead", ModelRunner.compile_graph_kernels)
ModelRunner.capture_graphs = counted("capture", ModelRunner.capture_graphs)
llm = LLM(sys.argv[1], **json.loads(sys.argv[2]))
params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
outputs = llm.generate(json.loads(sys.argv[3]), params, use_tqdm=False)
print(json.dumps({**compiles, "tokens": [o["token_ids"] for o in outputs]}))
"""


def build_and_decode(model_dir: str, settings: dict, prompts: list, ahead: bool) -> dict:
    """``BUILD_AND_DECODE``'s counts and tokens, compiling ahead or not."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    env[SWITCH_ENV] = "1" if ahead else "0"
    done = subprocess.run([sys.executable, "-c", BUILD_AND_DECODE, model_dir,
                           json.dumps(settings), json.dumps(prompts)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@cuda
def test_graph_kernels_compile_ahead_and_the_capture_compiles_nothing_more(qwen3_dir, tmp_path):
    """Two engines, each in a fresh process with a fresh compile cache: compiling ahead, the
    pass ahead compiles Triton kernels and the captures compile none; with
    ``QLLM_COMPILE_AHEAD=0`` the captures compile them; and both engines decode the same tokens
    (bf16: the same kernels and graphs, so the same bits)."""
    prompts = [[5, 9, 2, 7], [3, 1, 4, 1, 5, 9, 2, 6]]
    settings = dict(device="cuda", dtype="bfloat16", max_num_seqs=4, max_model_len=256,
                    cudagraph_batch_sizes=(1, 2, 4), kv_cache_memory_bytes=1 << 30)
    ahead = build_and_decode(qwen3_dir, {**settings, "compile_cache_dir": str(tmp_path / "a")},
                             prompts, ahead=True)
    plain = build_and_decode(qwen3_dir, {**settings, "compile_cache_dir": str(tmp_path / "p")},
                             prompts, ahead=False)
    assert ahead["ahead"] > 0 and ahead["capture"] == 0, ahead
    assert "ahead" not in plain and plain["capture"] > 0, plain
    assert ahead["tokens"] == plain["tokens"]
