"""compile_launches as graph capture uses it (QLLM_COMPILE_AHEAD=1): the switch, and on CUDA
graph buckets whose Triton kernels compiled ahead, the capture compiling nothing more and the
graphs decoding an eager engine's tokens. The launch-to-compile mechanism itself is tested
through ``compile_ahead`` (tests/test_compile_ahead.py), which shares it."""

from __future__ import annotations

import logging

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
    engine = LLM(qwen3_dir).engine
    assert not engine.compile_ahead and not engine.runner.compile_ahead


@cuda
def test_graph_kernels_compile_ahead_and_the_capture_compiles_nothing_more(qwen3_dir, tmp_path):
    """An engine captured at 4 sequences; then batch sizes 1 and 2 compiled ahead (Triton
    compiles counted, in a fresh Triton cache) and captured (nothing more compiled), their
    graphs decoding the tokens of an engine that captured 1, 2 and 4 as it went (bf16: the
    same kernels and graphs, so the same bits)."""
    from qllm import LLM, SamplingParams
    from qllm.runner.cuda_graphs import CudaGraphCapture
    from qllm.runner.triton_compiles import TritonCompileLog

    prompts = [[5, 9, 2, 7], [3, 1, 4, 1, 5, 9, 2, 6]]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    settings = dict(device="cuda", dtype="bfloat16", max_num_seqs=4, max_model_len=256,
                    kv_cache_memory_bytes=1 << 30)  # two engines share the GPU
    llm = LLM(qwen3_dir, compile_cache_dir=str(tmp_path), cudagraph_batch_sizes=(4,),
              **settings)  # QLLM_COMPILE_AHEAD unset: the capture compiled as it went
    runner = llm.engine.runner
    runner.config.cudagraph_batch_sizes = (1, 2, 4)
    log = TritonCompileLog().start()
    try:
        with torch.inference_mode():
            runner.compile_graph_kernels()
            compiled_ahead = log.summary()["compiled"]
            runner.graphs = runner.capture_graphs(False, runner.decode_graph_sizes(),
                                                  CudaGraphCapture(runner.device))
    finally:
        log.stop()
    assert compiled_ahead > 0 and log.summary()["compiled"] == compiled_ahead
    tokens = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
    plain = LLM(qwen3_dir, cudagraph_batch_sizes=(1, 2, 4), **settings)
    assert tokens == [o["token_ids"] for o in plain.generate(prompts, params, use_tqdm=False)]
