"""The decode-graph plumbing (buckets, padding rows, static input buffers, padding block and
slot) on the CPU, with a stand-in for CUDA graphs that reruns the captured call on replay."""

from __future__ import annotations

import pytest
import torch

from qllm import LLM, SamplingParams
from qllm.batch import ScheduledBatch
from qllm.testing import assert_cache_free, random_prompts, with_decode_graphs


@pytest.fixture(params=["qwen3", "qwen3_5_moe"])
def checkpoint(request, qwen3_dir, tmp_path):
    if request.param == "qwen3":
        return qwen3_dir
    testing = pytest.importorskip("qllm_qwen3_5.testing")
    testing.save_checkpoint(request.param, str(tmp_path))
    return str(tmp_path)


def test_graph_replay_equals_eager(checkpoint):
    prompts = random_prompts([5, 40, 17, 66, 9])
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
              for n in (12, 30, 3, 21, 8)]  # the batch shrinks through every bucket
    expected = LLM(checkpoint, block_size=16).generate(prompts, params, use_tqdm=False)
    llm = with_decode_graphs(LLM(checkpoint, block_size=16, max_num_seqs=8), [1, 2, 4, 8])
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [g["token_ids"] for g in got] == [e["token_ids"] for e in expected]
    assert_cache_free(llm)


def test_replay_refuses_inputs_staged_for_another_layout(qwen3_dir):
    """The replay copies the step's staged buffer over the graph's, so both must share one
    layout; a step prepared without the graph's fixed layout (block tables one block wide
    here, not max_model_len's) is refused, not misread."""
    llm = with_decode_graphs(LLM(qwen3_dir, block_size=16, max_num_seqs=2), [1, 2])
    runner = llm.engine.runner
    dummy = ScheduledBatch([], [], is_prefill=False)
    with torch.inference_mode():
        input_ids, positions, batch = runner.prepare(dummy, pad_to=2)
        assert batch.caches["paged_kv"].block_tables.shape == (2, 1)
        with pytest.raises(ValueError, match="'paged_kv.block_tables' is laid out unlike the "
                                             "graph's"):
            runner.graphs.replay(input_ids, positions, batch)
