"""The CUDA-graph plumbing of decode and prefill steps (buckets, inert padding rows, static
input buffers, padding block and slot) on the CPU, with a stand-in for CUDA graphs that reruns
the captured call on replay."""

from __future__ import annotations

import pytest
import torch

from qllm import LLM, SamplingParams
from qllm.batch import ScheduledBatch
from qllm.runner.cuda_graphs import GraphShape
from qllm.testing import (assert_cache_free, random_prompts, record_replays, with_decode_graphs,
                          with_prefill_graphs)


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
        input_ids, positions, batch = runner.prepare(dummy, GraphShape(False, 2))
        assert batch.caches["paged_kv"].block_tables.shape == (2, 1)
        with pytest.raises(ValueError, match="'paged_kv.block_tables' is laid out unlike the "
                                             "graph's"):
            runner.graphs.replay(input_ids, positions, batch)


@pytest.mark.parametrize("prefix_state_cache_slots", [0, 4])
def test_prefill_graph_replay_equals_eager(checkpoint, prefix_state_cache_slots):
    """One sequence at a time (max_num_seqs=1), each prompt's last prefill step replays the
    bucket that holds it: padded with an inert row (none left over for a prompt of exactly a
    bucket's size, 16), after a prefix-cache hit (the repeated prompt heads), and after an
    eager chunk (a 70-token prompt in steps of at most 48 tokens); a prompt longer than the
    largest bucket (56 tokens) stays eager. With recurrent-state checkpoints, a hybrid
    model's step that saves one on the way stays eager too."""
    heads = random_prompts([5, 16, 23, 56, 70], seed=1)
    prompts = heads + [head + tail for head, tail in zip(heads, random_prompts([3, 11, 9],
                                                                               seed=2))]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    settings = dict(block_size=16, max_num_seqs=1, max_num_batched_tokens=48,
                    prefix_state_cache_slots=prefix_state_cache_slots)
    expected = LLM(checkpoint, **settings).generate(prompts, params, use_tqdm=False)
    llm = with_prefill_graphs(LLM(checkpoint, **settings), [16, 32])
    replayed = record_replays(llm.engine.runner.prefill_graphs)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [g["token_ids"] for g in got] == [e["token_ids"] for e in expected]
    assert set(replayed) <= {16, 32}, replayed
    if prefix_state_cache_slots:  # a step passing a block's end with no checkpoint saves one
        assert len(replayed) >= 3, replayed
    else:
        assert len(replayed) >= 5 and 32 in replayed, replayed
    assert_cache_free(llm)


def test_prefill_graph_padding_rows_name_only_padding_units(qwen3_dir):
    """A prefill graph's inert row takes the rest of the bucket's tokens at positions 0..,
    in the padding block (wrapping inside it) and the padding slot alone."""
    llm = LLM(qwen3_dir, block_size=16, max_num_seqs=1)
    runner = llm.engine.runner
    prompt = random_prompts([5])[0]
    llm.engine.add_request(prompt, SamplingParams(max_tokens=1))
    scheduled = llm.engine.scheduler.schedule()
    inputs = runner.host_inputs(scheduled, GraphShape(True, 32), fixed_layout=True)
    fields = inputs.fields
    padding_block = llm.engine.cache.pools["paged_kv"].padding_unit
    assert fields["query_start_loc"][0] == [0, 5, 32]
    assert fields["positions"][0] == list(range(5)) + list(range(27))
    assert fields["logits_indices"][0] == [4, 31]
    assert fields["paged_kv.slot_mapping"][0][5:] == [padding_block * 16 + p % 16
                                                      for p in range(27)]
    assert inputs.num_sampled == 1


def test_prefill_graphs_recompute_preempted_sequences(qwen3_dir):
    """With too few KV blocks for every running sequence, the scheduler preempts and later
    recomputes a sequence's prompt and generated tokens in one prefill: through a prefill graph
    where it fits, with the same greedy tokens as eager."""
    prompts = random_prompts([20, 25, 30])
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    settings = dict(block_size=16, max_num_seqs=3, num_kv_blocks=7, max_model_len=64)
    expected = LLM(qwen3_dir, **settings).generate(prompts, params, use_tqdm=False)
    llm = with_prefill_graphs(LLM(qwen3_dir, **settings), [16, 32, 64])
    replayed = record_replays(llm.engine.runner.prefill_graphs)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [g["token_ids"] for g in got] == [e["token_ids"] for e in expected]
    assert llm.engine.scheduler.num_preemptions > 0 and replayed
    assert_cache_free(llm)
