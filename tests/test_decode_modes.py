"""benchmarks/decode_modes.py on the CPU, tiny models: reduce-overhead's whole-model compile
of the decode forward gives today's logits on the same step and cache contents (on the CPU
Inductor records no CUDA graph, so this checks the plumbing and the numbers, not the
times), and a hybrid model's step reruns from the same state only once it is put back."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from qllm import LLM
from qllm.testing import with_decode_graphs

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import decode_modes  # noqa: E402
from profile_step import model_len_needed, queue_requests  # noqa: E402

BATCH, CONTEXT, STEPS = 2, 20, 2
VOCAB = 10240  # profile_step's prompts take token ids below 10,000


@pytest.fixture(params=["qwen3", "qwen3_5"])
def llm(request, tmp_path):
    """An idle engine with eager layers and a rerun decode "graph" of ``BATCH`` sequences."""
    if request.param == "qwen3":
        from qllm.testing import require_qwen3_plugin, save_tiny_qwen3

        require_qwen3_plugin()
        save_tiny_qwen3(tmp_path, vocab_size=VOCAB)
    else:
        testing = pytest.importorskip("qllm_qwen3_5.testing")
        testing.save_checkpoint(request.param, str(tmp_path), vocab_size=VOCAB,
                                num_hidden_layers=2,
                                layer_types=["linear_attention", "full_attention"])
    engine = LLM(str(tmp_path), block_size=16, max_num_seqs=BATCH,
                 max_model_len=model_len_needed(CONTEXT, STEPS))
    return with_decode_graphs(engine, [BATCH])


def test_reduce_overhead_logits_equal_todays(llm):
    figures = decode_modes.measure(llm, BATCH, CONTEXT, STEPS)
    print(json.dumps(figures))  # plain numbers only
    agreement = figures["agreement"]
    assert agreement["rerun_max_abs_diff"] == 0, "today's step did not rerun from its state"
    assert agreement["max_abs_diff"] < 1e-4 and agreement["argmax_equal"] == 1, agreement
    assert figures["reduce_overhead"]["first_call_seconds"] > 0


@pytest.mark.parametrize("llm", ["qwen3_5"], indirect=True)
def test_hybrid_step_reruns_from_the_same_state_only_once_put_back(llm):
    """A decode step advances the recurrent state in place, so a rerun of it differs unless
    ``SavedState`` puts the state back first."""
    engine = llm.engine
    with torch.inference_mode():
        queue_requests(engine, "decode", BATCH, CONTEXT, STEPS)
        graph, inputs = decode_modes.fixed_step(engine)
        state = decode_modes.SavedState(engine, inputs[2])
        first = engine.runner.replay(graph, *inputs).clone()
        advanced = engine.runner.replay(graph, *inputs).clone()
        state.restore()
        rerun = engine.runner.replay(graph, *inputs).clone()
    assert not torch.equal(advanced, first)
    assert torch.equal(rerun, first)
