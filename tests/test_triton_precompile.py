"""compile_launches as graph capture uses it (QLLM_COMPILE_AHEAD=1): the switch, and on CUDA
graph buckets whose Triton kernels compiled ahead, the capture compiling nothing more and the
graphs decoding an eager engine's tokens. The launch-to-compile mechanism itself is tested
through ``compile_ahead`` (tests/test_compile_ahead.py), which shares it."""

from __future__ import annotations

import pytest
import torch

from qllm.runner.triton_precompile import SWITCH_ENV, compile_ahead_enabled
from qllm.testing.kernels import cuda


def test_off_unless_switched_on(monkeypatch):
    monkeypatch.delenv(SWITCH_ENV, raising=False)
    assert not compile_ahead_enabled()
    monkeypatch.setenv(SWITCH_ENV, "1")
    assert compile_ahead_enabled()
    monkeypatch.setenv(SWITCH_ENV, "yes")
    with pytest.raises(ValueError, match=SWITCH_ENV):
        compile_ahead_enabled()


@cuda
def test_graph_kernels_compile_ahead_and_the_capture_compiles_nothing_more(qwen3_dir, tmp_path):
    """An engine captured at 4 sequences; then batch sizes 1 and 2 compiled ahead (Triton
    compiles counted, in a fresh Triton cache) and captured (nothing more compiled), their
    graphs decoding the tokens of an eager engine."""
    from qllm import LLM, SamplingParams
    from qllm.runner.cuda_graphs import CudaGraphCapture
    from qllm.runner.triton_compiles import TritonCompileLog

    prompts = [[5, 9, 2, 7], [3, 1, 4, 1, 5, 9, 2, 6]]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    settings = dict(device="cuda", max_num_seqs=4, max_model_len=256)
    llm = LLM(qwen3_dir, compile_cache_dir=str(tmp_path), cudagraph_batch_sizes=(4,),
              **settings)
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
    eager = LLM(qwen3_dir, enforce_eager=True, **settings)
    assert tokens == [o["token_ids"] for o in eager.generate(prompts, params, use_tqdm=False)]
