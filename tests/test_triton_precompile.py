"""compile_launches as graph capture uses it (QLLM_COMPILE_AHEAD=1): the switch, and on CUDA
graph buckets whose Triton kernels compiled ahead, the capture compiling nothing more and the
graphs decoding the tokens of an engine that compiled as it captured. The launch-to-compile
mechanism itself is tested through ``compile_ahead`` (tests/test_compile_ahead.py), which
shares it."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import torch

from qllm.runner.triton_precompile import SWITCH_ENV, compile_ahead_enabled
from qllm.testing.kernels import cuda


PLUGIN_KERNELS = {"fused_moe": "triton", "moe_router": "triton", "linear": "triton"}


def test_off_unless_switched_on_and_every_op_on_a_plugin_kernel(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="qllm.runner.triton_precompile")
    monkeypatch.delenv(SWITCH_ENV, raising=False)
    assert not compile_ahead_enabled(PLUGIN_KERNELS)
    monkeypatch.setenv(SWITCH_ENV, "1")
    assert compile_ahead_enabled(PLUGIN_KERNELS)
    # the fused_moe reference would count the experts' slots from unwritten router ids
    assert not compile_ahead_enabled({**PLUGIN_KERNELS, "fused_moe": "torch"})
    assert "ops on their plain-torch references: fused_moe" in caplog.text
    monkeypatch.setenv(SWITCH_ENV, "yes")
    with pytest.raises(ValueError, match=SWITCH_ENV):
        compile_ahead_enabled(PLUGIN_KERNELS)


def test_an_engine_on_the_cpu_never_compiles_ahead(qwen3_dir, monkeypatch):
    from qllm import LLM

    monkeypatch.setenv(SWITCH_ENV, "1")
    engine = LLM(qwen3_dir, device="cpu").engine
    assert not engine.compile_ahead and not engine.runner.compile_ahead


# An engine captured at 4 sequences, then batch sizes 1 and 2 compiled ahead (Triton's
# compiles counted) and captured; prints the compiles ahead, all compiles, and the tokens of
# its graphs. In a fresh process: Triton keeps the kernels it compiled in memory, so an engine
# built earlier in this one would have compiled them already.
CAPTURE_AHEAD = """
import json, sys
import torch
from qllm import LLM, SamplingParams
from qllm.runner.cuda_graphs import CudaGraphCapture
from qllm.runner.triton_compiles import TritonCompileLog
settings = json.loads(sys.argv[2])
llm = LLM(sys.argv[1], cudagraph_batch_sizes=(4,), **settings)
runner = llm.engine.runner
runner.config.cudagraph_batch_sizes = (1, 2, 4)
log = TritonCompileLog().start()
with torch.inference_mode():
    runner.compile_graph_kernels()
    ahead = log.summary()["compiled"]
    runner.graphs = runner.capture_graphs(False, runner.decode_graph_sizes(),
                                          CudaGraphCapture(runner.device))
log.stop()
params = SamplingParams(max_tokens=12, ignore_eos=True)
outputs = llm.generate(json.loads(sys.argv[3]), params, use_tqdm=False)
print(json.dumps({"ahead": ahead, "compiled": log.summary()["compiled"],
                  "tokens": [o["token_ids"] for o in outputs]}))
"""


@cuda
def test_graph_kernels_compile_ahead_and_the_capture_compiles_nothing_more(qwen3_dir, tmp_path):
    """In a fresh process with a fresh compile cache (``CAPTURE_AHEAD``), batch sizes 1 and 2
    compile Triton kernels ahead and their capture compiles nothing more; their graphs decode
    the tokens of an engine that captured 1, 2 and 4 as it went (bf16: the same kernels and
    graphs, so the same bits)."""
    from qllm import LLM, SamplingParams

    prompts = [[5, 9, 2, 7], [3, 1, 4, 1, 5, 9, 2, 6]]
    settings = dict(device="cuda", dtype="bfloat16", max_num_seqs=4, max_model_len=256,
                    kv_cache_memory_bytes=1 << 30)  # two engines share the GPU
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    env.pop(SWITCH_ENV, None)  # the first capture compiles as it goes
    done = subprocess.run(
        [sys.executable, "-c", CAPTURE_AHEAD, qwen3_dir,
         json.dumps({**settings, "compile_cache_dir": str(tmp_path)}), json.dumps(prompts)],
        env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    ahead = json.loads(done.stdout.strip().splitlines()[-1])
    assert ahead["ahead"] > 0 and ahead["compiled"] == ahead["ahead"], ahead
    plain = LLM(qwen3_dir, cudagraph_batch_sizes=(1, 2, 4), **settings)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    assert ahead["tokens"] == [o["token_ids"]
                               for o in plain.generate(prompts, params, use_tqdm=False)]
