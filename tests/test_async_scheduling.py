"""Async scheduling (batch N launched before the tokens of N-1 are read) gives exactly the
outputs of synchronous stepping, whatever stops the sequences, and really pipelines."""

from __future__ import annotations

import collections

import pytest

from qllm import LLM, SamplingParams
from qllm.runner.model_runner import SampledStep
from qllm.testing import InjectedFailure, assert_cache_free, fail_on_call, random_prompts

ENGINE = dict(block_size=16, max_model_len=256)


def mixed_requests(eos: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts with every way of stopping: max_tokens of 1 and more, eos (the id the model
    emits most), stop token ids, max_model_len, seeded sampling, and greedy."""
    prompts = random_prompts([3, 17, 40, 64, 100, 129, 7, 33, 200, 250])
    params = [
        SamplingParams(temperature=0, max_tokens=1),
        SamplingParams(temperature=0, max_tokens=40),
        SamplingParams(temperature=0, max_tokens=60, stop_token_ids=[eos]),
        SamplingParams(temperature=0.8, seed=7, max_tokens=50),
        SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=3, max_tokens=30),
        SamplingParams(temperature=0, max_tokens=64),
        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
        SamplingParams(temperature=0.5, seed=11, max_tokens=64),
        SamplingParams(temperature=0, max_tokens=100, ignore_eos=True),  # max_model_len
        SamplingParams(temperature=0, max_tokens=2),
    ]
    return prompts, params


def most_common_greedy_token(path: str) -> int:
    """The token that most of the mixed requests' greedy continuations contain."""
    llm = LLM(path, async_scheduling=False, **ENGINE)
    prompts, _ = mixed_requests(eos=0)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=64,
                                                   ignore_eos=True), use_tqdm=False)
    counts = collections.Counter(t for o in outputs for t in set(o["token_ids"]))
    return counts.most_common(1)[0][0]


@pytest.mark.parametrize("options", [
    pytest.param({}, id="together"),
    pytest.param({"num_kv_blocks": 30}, id="preemption"),
    pytest.param({"max_num_batched_tokens": 48}, id="chunked-prefill"),
    pytest.param({"max_num_seqs": 3}, id="few-seqs"),
])
def test_async_equals_sync(qwen3_dir, options):
    eos = most_common_greedy_token(qwen3_dir)
    prompts, params = mixed_requests(eos)
    outputs = {}
    for mode in (False, True):
        llm = LLM(qwen3_dir, async_scheduling=mode, **ENGINE, **options)
        llm.engine.eos_token_ids = {eos}  # the model now really stops on eos
        outputs[mode] = llm.generate(prompts, params, use_tqdm=False)
        assert_cache_free(llm)
        assert all(seq.num_pending_tokens == 0 for seq in llm.engine.sequences.values())
    for sync, pipelined in zip(outputs[False], outputs[True]):
        assert pipelined["token_ids"] == sync["token_ids"]
        assert pipelined["finish_reason"] == sync["finish_reason"]
    reasons = {o["finish_reason"] for o in outputs[True]}
    assert reasons == {"stop", "length"}, "the requests should stop both ways"


def test_batches_are_launched_before_the_previous_tokens_are_read(qwen3_dir, monkeypatch):
    llm = LLM(qwen3_dir, **ENGINE)
    events = []
    launch, tokens = llm.engine.runner.launch, SampledStep.tokens

    # the events hold the steps themselves: an id() of a freed step may be reused by a later one
    def recording_launch(batch, previous=None, **options):
        step = launch(batch, previous, **options)
        events.append(("launch", step))
        return step

    def recording_tokens(step):
        events.append(("read", step))
        return tokens(step)

    def position(kind, step):
        return next(i for i, (k, s) in enumerate(events) if k == kind and s is step)

    monkeypatch.setattr(llm.engine.runner, "launch", recording_launch)
    monkeypatch.setattr(SampledStep, "tokens", recording_tokens)
    llm.generate(random_prompts([10, 20]), SamplingParams(temperature=0, max_tokens=6,
                                                          ignore_eos=True), use_tqdm=False)
    launched = [step for kind, step in events if kind == "launch"]
    for before, after in zip(launched, launched[1:]):  # N+1 is launched before N is read
        assert position("launch", after) < position("read", before)
    assert [kind for kind, _ in events].count("read") == len(launched)


def test_interrupted_generate_leaves_the_engine_usable(qwen3_dir, monkeypatch):
    """A generate interrupted with a step in flight aborts its requests; the next generate
    resolves the stale step and gives the same tokens as a fresh engine."""
    prompts = random_prompts([12, 30, 50])
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    expected = LLM(qwen3_dir, **ENGINE).generate(prompts, params, use_tqdm=False)

    llm = LLM(qwen3_dir, **ENGINE)
    step, calls = llm.engine.step, []

    def interrupted_step():
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return step()

    monkeypatch.setattr(llm.engine, "step", interrupted_step)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine._in_flight is not None, "the interruption should leave a step in flight"
    monkeypatch.setattr(llm.engine, "step", step)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [g["token_ids"] for g in got] == [e["token_ids"] for e in expected]
    assert_cache_free(llm)


@pytest.mark.parametrize("pipelined", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("failing", ["runner.launch", "scheduler.postprocess"])
def test_failed_step_leaves_the_engine_usable(qwen3_dir, monkeypatch, pipelined, failing):
    """A step that fails while launching or while taking its tokens (with a step in flight
    behind it, when pipelined) raises out of generate, which aborts its requests; the next
    generate gives a fresh engine's tokens and frees every cache unit."""
    prompts = random_prompts([12, 30, 50])
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    expected = LLM(qwen3_dir, **ENGINE).generate(prompts, params, use_tqdm=False)

    llm = LLM(qwen3_dir, async_scheduling=pipelined, **ENGINE)
    part, method = failing.split(".")
    fail_on_call(monkeypatch, getattr(llm.engine, part), method, call=4)
    with pytest.raises(InjectedFailure):
        llm.generate(prompts, params, use_tqdm=False)
    assert (llm.engine._in_flight is not None) == pipelined, "a step should be in flight"
    monkeypatch.undo()
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [g["token_ids"] for g in got] == [e["token_ids"] for e in expected]
    assert_cache_free(llm)
    assert not llm.engine.sequences
